"""Faults injected on purpose into ``launch/train_gpt.py`` (``--inject-fault
KIND[:RANK[:ITERATION]]``), so a learner sees what a broken distributed job does and how it is
diagnosed (lab 17); and a rank killed in the middle of a checkpoint save
(``MPU_LAB_FAULT_IN_SAVE=RANK:ITERATION``, the reliability tests).

The lab's own (Megatron-LM has no fault injection), kept in ``training/`` beside the loop it
breaks (``launch/train_gpt.py`` imports it; the lab kit only starts the jobs), and it stays out
of the training loop: the faults enter through the seams any user of the loop has. :func:`inject` gives the callbacks
(:class:`mpu_lab.training.training.Callback`) that ``train(..., callbacks=...)`` calls before a
step, before its optimizer step and after its loss average (:class:`Injection` says what each
kind does where), and :func:`kill_in_save` a ``torch.distributed.checkpoint`` writer (a
``FileSystemWriter`` subclass) for ``train(..., storage_writer=...)``. Each kind is something
that goes wrong in real jobs (Megatron-LM issue #881 and nanotron issue #209 are hangs):

* a collective fault (hang, skip-collective, mismatched-shape, wrong-group, pp-deadlock) makes
  the other ranks wait until the collective timeout (``MPU_LAB_TIMEOUT_S``), or makes gloo
  refuse the message, and :func:`mpu_lab.launcher.run` raises ``LaunchError`` naming where each
  rank stood;
* crash: a rank raises; the others lose their peer at once;
* divergence finishes with plausible losses: only the dense twin shows it
  (:func:`mpu_lab.labkit.debugging.twin_check.compare_with_dense_twin`);
* fp16-overflow finishes too: the step is skipped on every rank and the loss scale halved from
  the ``--hysteresis``-th overflow on, as Megatron's dynamic loss scaler does
  (``skipped_iterations``, ``loss_scale`` in the metrics).

``RANK`` is a global rank (default 1) and ``ITERATION`` the 1-based iteration of the log lines
(default 2: the first step runs as usual). :func:`check_fault` says which flags a kind needs;
:func:`check_launch_args` is the script's ``PRECHECK``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state
from mpu_lab.training.checkpointing import iteration_dir
from mpu_lab.core.optimizer import DynamicGradScaler, clip_grad_norm
from mpu_lab.training import arguments
from mpu_lab.training import training as loop

SAVE_FAULT_ENV = "MPU_LAB_FAULT_IN_SAVE"

# kind -> what is injected, what a learner should take from it, which flags it needs
FAULT_KINDS: Dict[str, Dict[str, str]] = {
    "hang": {
        "what": "the rank sleeps at the start of the step instead of computing it",
        "needs": "at least 2 ranks",
        "cause": "A rank that never reaches a collective (stuck in its own code: a sleep, a "
                 "lock, slow I/O, an endless loop) leaves every other rank waiting in it until "
                 "the collective timeout."},
    "skip-collective": {
        "what": "the rank does not enter an all-reduce that the other ranks of its "
                "data-parallel group enter, averaging the loss for a log line after the step "
                "(a rank-dependent `if` around a collective)",
        "needs": "a data-parallel size > 1 (at PP > 1: a last-stage rank)",
        "cause": "A collective that not every rank calls never completes: the ranks that "
                 "entered it wait, and the rank that skipped it waits in its next one."},
    "mismatched-shape": {
        "what": "the rank all-reduces a tensor of 2 elements where the others all-reduce the "
                "1-element loss (averaging it for a log line after the step)",
        "needs": "a data-parallel size > 1 (at PP > 1: a last-stage rank)",
        "cause": "Ranks that pass tensors of different sizes to the same collective cannot "
                 "agree on the message: gloo refuses it or waits until the timeout, NCCL may "
                 "hang or return garbage."},
    "wrong-group": {
        "what": "the rank sums the gradient norm over the data-parallel group where the "
                "tensor-parallel (model-parallel) group was meant (every rank measures it "
                "before the optimizer step)",
        "needs": "--tensor-model-parallel-size > 1 and a data-parallel size > 1",
        "cause": "A collective issued on the wrong process group pairs ranks that are not "
                 "waiting for each other: some wait forever, others silently combine "
                 "unrelated values."},
    "crash": {
        "what": "the rank raises a RuntimeError after its backward, before the optimizer step",
        "needs": "nothing",
        "cause": "One rank raised an exception of its own; the other ranks fail only because "
                 "their peer went away, so the first traceback is the one to read."},
    "pp-deadlock": {
        "what": "the rank's pipeline stage and its neighbour both send an activation first "
                "with a blocking send, then receive",
        "needs": "--pipeline-model-parallel-size > 1",
        "cause": "Two stages that both block in send before receiving wait for each other "
                 "forever: post the send and the receive together (batch_isend_irecv), as "
                 "Megatron's p2p_communication does."},
    "divergence": {
        "what": "the rank's shard of one weight matrix is re-drawn from another seed at the "
                "start of the step (as a shard initialised apart from the master weight)",
        "needs": "nothing (add --dense-twin to compare)",
        "cause": "Ranks whose weights (or dropout seeds) disagree train a different model "
                 "without any error: the loss drifts from the dense twin's."},
    "fp16-overflow": {
        "what": "the rank's fp16 gradients overflow (its loss scale is multiplied by 2^64 for "
                "one backward)",
        "needs": "--fp16",
        "cause": "A loss scale too large for fp16 turns gradients into inf: the dynamic loss "
                 "scaler skips the step on every rank and halves the scale from the "
                 "--hysteresis-th overflow since it last grew (2 by default), and the loss "
                 "goes on as if that iteration had not happened."},
}

DEFAULT_RANK = 1
DEFAULT_ITERATION = 2
OVERFLOW_FACTOR = 2.0 ** 64
SPEC = "KIND[:RANK[:ITERATION]]"


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` (a key of :data:`FAULT_KINDS`), the global ``rank`` that
    misbehaves and the 1-based ``iteration`` it does so in."""
    kind: str
    rank: int = DEFAULT_RANK
    iteration: int = DEFAULT_ITERATION

    def __str__(self) -> str:
        return f"{self.kind}:{self.rank}:{self.iteration}"


def parse_fault(spec: str) -> Fault:
    """``"hang"``, ``"crash:0"``, ``"divergence:1:5"`` -> :class:`Fault`. A ``ValueError``
    names the format and the valid kinds."""
    valid = ", ".join(FAULT_KINDS)
    parts = str(spec).strip().split(":")
    if not parts[0] or len(parts) > 3:
        raise ValueError(f"--inject-fault {spec!r}: expected {SPEC} (e.g. hang, crash:0, "
                         f"divergence:1:5); KIND is one of {valid}")
    kind = parts[0].strip().lower()
    if kind not in FAULT_KINDS:
        raise ValueError(f"--inject-fault {spec!r}: unknown fault kind {kind!r}; valid kinds "
                         f"are {valid} (format {SPEC})")
    numbers = []
    for name, text in zip(("RANK", "ITERATION"), parts[1:]):
        try:
            numbers.append(int(text))
        except ValueError:
            raise ValueError(f"--inject-fault {spec!r}: {name} must be an integer, got "
                             f"{text!r} (format {SPEC})") from None
    rank = numbers[0] if numbers else DEFAULT_RANK
    iteration = numbers[1] if len(numbers) > 1 else DEFAULT_ITERATION
    if rank < 0 or iteration < 1:
        raise ValueError(f"--inject-fault {spec!r}: RANK must be >= 0 and ITERATION >= 1 "
                         f"(the first logged iteration is 1), got {rank} and {iteration}")
    return Fault(kind, rank, iteration)


def check_fault(fault: Fault, args) -> None:
    """The flags ``fault`` needs, checked before any process starts (``args`` validated for
    the world: ``world_size``, ``data_parallel_size`` filled in). ``ValueError`` names what to
    change."""
    world, tp, pp = args.world_size, args.tensor_model_parallel_size, \
        args.pipeline_model_parallel_size
    dp = args.data_parallel_size
    here = (f"here: {world} ranks, --tensor-model-parallel-size {tp}, "
            f"--pipeline-model-parallel-size {pp}, data-parallel size {dp}")
    if fault.iteration > args.train_iters:
        raise ValueError(f"--inject-fault {fault}: iteration {fault.iteration} is after the "
                         f"last one (--train-iters {args.train_iters})")
    need = None
    if fault.kind in ("hang", "skip-collective", "mismatched-shape", "wrong-group",
                      "pp-deadlock") and world < 2:
        need = "at least 2 ranks (a collective fault needs a peer to wait for)"
    elif fault.kind in ("skip-collective", "mismatched-shape") and dp < 2:
        need = ("a data-parallel size > 1 (it acts on the loss all-reduce over the data-parallel "
                "group), e.g. 2 ranks with the default sizes")
    elif fault.kind == "wrong-group" and (tp < 2 or dp < 2):
        need = ("--tensor-model-parallel-size > 1 and a data-parallel size > 1 (both groups "
                "must exist), e.g. 4 ranks with --tensor-model-parallel-size 2")
    elif fault.kind == "pp-deadlock" and pp < 2:
        need = "--pipeline-model-parallel-size > 1 (two stages that send to each other)"
    elif fault.kind == "fp16-overflow" and not args.fp16:
        need = "--fp16 (the dynamic loss scale lives there)"
    if need:
        raise ValueError(f"--inject-fault {fault.kind} needs {need}; {here}")
    if fault.rank >= world:
        raise ValueError(f"--inject-fault {fault}: rank {fault.rank} is outside the world of "
                         f"{world} ranks; valid ranks are 0..{world - 1}")
    if fault.kind in ("skip-collective", "mismatched-shape") and pp > 1:
        stage = parallel_state.rank_coordinates(fault.rank, world, tp, pp)["pp"]
        if stage != pp - 1:
            last = [r for r in range(world)
                    if parallel_state.rank_coordinates(r, world, tp, pp)["pp"] == pp - 1]
            raise ValueError(f"--inject-fault {fault}: at pipeline-parallel size {pp} the loss "
                             f"all-reduce runs on the last stage only; pick one of its ranks "
                             f"{last} (rank {fault.rank} is on stage {stage})")


# --------------------------------------------------------------------------- the flag
def add_fault_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--inject-fault``: the ``extra_args_provider`` that ``launch/train_gpt.py`` gives
    :func:`mpu_lab.training.parse_args`."""
    g = parser.add_argument_group("debugging (lab 17): injected faults")
    g.add_argument("--inject-fault", default=None, metavar=SPEC,
                   help="make one rank misbehave on purpose (mpu_lab.training.faults): "
                        + ", ".join(FAULT_KINDS) + f"; RANK default {DEFAULT_RANK}, the "
                        f"1-based ITERATION default {DEFAULT_ITERATION}")
    return parser


def fault_of(args) -> Optional[Fault]:
    """The fault ``--inject-fault`` asks for, checked against ``args`` (validated for the
    world: :func:`mpu_lab.training.validate_args`); None without the flag."""
    spec = getattr(args, "inject_fault", None)
    if not spec:
        return None
    fault = parse_fault(spec)
    check_fault(fault, args)
    return fault


def check_launch_args(argv: Sequence[str], world_size: int, cwd=None) -> argparse.Namespace:
    """``launch/train_gpt.py``'s ``PRECHECK``: the training flags
    (:func:`mpu_lab.training.arguments.check_launch_args`), ``--inject-fault`` among them,
    then the fault against them (:func:`fault_of`)."""
    args = arguments.check_launch_args(argv, world_size, cwd, extra_args_provider=add_fault_args)
    fault_of(args)
    return args


# --------------------------------------------------------------------------- in the job
def announce(fault: Fault) -> None:
    """One line on the faulty rank's output, with the wall clock (``time.time()``), so a test
    or a lab can measure how long the job takes to fail from here."""
    print(f"[inject-fault] {fault.kind} on rank {fault.rank} at iteration {fault.iteration} "
          f"(time {time.time():.3f})", flush=True)


def hang() -> None:
    """The rank sleeps instead of computing its step; torchrun stops it when the others time
    out."""
    time.sleep(24 * 3600)


def crash(fault: Fault) -> None:
    raise RuntimeError(f"rank {fault.rank} raised at iteration {fault.iteration} "
                       f"(fault injected by --inject-fault crash)")


def redraw_one_shard(state) -> None:
    """Re-draw this rank's part of the first 2-D weight of its model from another seed."""
    weight = next(p for p in state.model.parameters() if p.dim() == 2)
    generator = torch.Generator().manual_seed(state.args.seed + 7919 * (dist.get_rank() + 1))
    fresh = torch.randn(weight.shape, generator=generator,
                        device="cpu") * state.args.init_method_std  # cpu: CPU generator
    with torch.no_grad():
        weight.copy_(fresh.to(weight.device, weight.dtype))


def send_first_to_neighbour(state, fault: Fault) -> None:
    """The fault's rank and its pipeline neighbour (the next stage; the previous one for
    the last stage) each send an activation-sized tensor with a blocking ``dist.send``, then
    receive the other's: neither receive is ever posted, so both sends wait until the
    timeout (NCCL blocks the same way; gloo's send waits for the matching receive)."""
    args, me = state.args, dist.get_rank()
    group = parallel_state.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    if fault.rank not in ranks:
        return
    at = ranks.index(fault.rank)
    peer = ranks[at + 1] if at + 1 < len(ranks) else ranks[at - 1]
    if me not in (fault.rank, peer):
        return
    other = peer if me == fault.rank else fault.rank
    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    on_device = dist.get_backend(group) == "nccl"   # gloo sends from host memory
    activation = torch.zeros(shape, device=initialize.get_device() if on_device else "cpu")
    dist.send(activation, dst=other, group=group)
    dist.recv(activation, src=other, group=group)


def grad_norm_over(state, group) -> float:
    """The gradient norm of this rank's model chunks, its squares summed over ``group``
    (``clip_grad_norm`` with ``max_norm = 0`` only measures): what a monitoring callback logs
    before the optimizer step."""
    params = [p for chunk in state.model_chunks for p in chunk.parameters() if p.requires_grad]
    return clip_grad_norm(params, 0.0, group)


def _multiply_scale(scaler: DynamicGradScaler, factor: float) -> None:
    state = scaler.state_dict()
    scaler.load_state_dict({**state, "scale": state["scale"] * factor})


class Injection(loop.Callback):
    """One fault as a callback of the training loop (:class:`mpu_lab.training.training.Callback`),
    passed to ``train(..., callbacks=[...])`` on every rank (pp-deadlock also acts on the fault
    rank's neighbour, the loss and norm faults on its peers). It acts in the fault's iteration
    only:

    * ``on_step_begin``: hang sleeps, divergence re-draws a shard, pp-deadlock sends first,
      fp16-overflow multiplies the rank's loss scale by 2^64 for the backward;
    * ``on_before_optimizer_step``: fp16-overflow gives the scaler back its true scale (it
      unscales the gradients with it); crash raises; wrong-group: every rank measures its
      gradient norm over the model-parallel group, the fault's rank over the data-parallel one;
    * ``on_step_end``: the ranks of the fault rank's data-parallel group average the loss once
      more for a log line (:meth:`loss_for_log`): skip-collective leaves that rank out,
      mismatched-shape gives it 2 elements.
    """

    def __init__(self, fault: Fault, rank: int):
        self.fault, self.rank = fault, rank
        self.in_fault_step = False
        self.inflated_scaler: Optional[DynamicGradScaler] = None

    @property
    def armed(self) -> bool:
        """This rank misbehaves in this step."""
        return self.in_fault_step and self.rank == self.fault.rank

    def on_step_begin(self, state) -> None:
        fault = self.fault
        self.in_fault_step = state.iteration + 1 == fault.iteration
        if self.armed:
            announce(fault)
        if self.in_fault_step and fault.kind == "pp-deadlock":
            send_first_to_neighbour(state, fault)   # on the fault's rank and its neighbour
        elif self.armed and fault.kind == "hang":
            hang()
        elif self.armed and fault.kind == "divergence":
            redraw_one_shard(state)
        elif self.armed and fault.kind == "fp16-overflow":
            # this rank's loss is scaled 2^64 times too much for one backward (through the
            # scaler's state dict, the way a checkpoint would set it)
            self.inflated_scaler = state.scaler
            _multiply_scale(state.scaler, OVERFLOW_FACTOR)

    def on_before_optimizer_step(self, state) -> None:
        if self.inflated_scaler is not None:
            _multiply_scale(self.inflated_scaler, 1.0 / OVERFLOW_FACTOR)
            self.inflated_scaler = None
        if self.armed and self.fault.kind == "crash":
            crash(self.fault)
        if self.in_fault_step and self.fault.kind == "wrong-group":
            group = parallel_state.get_data_parallel_group() if self.armed \
                else parallel_state.get_model_parallel_group()
            grad_norm_over(state, group)

    def on_step_end(self, state, step) -> None:
        if self.in_fault_step and self.fault.kind in ("skip-collective", "mismatched-shape"):
            group = parallel_state.get_data_parallel_group()
            if self.fault.rank in dist.get_process_group_ranks(group):
                loss = torch.tensor(step["lm_loss"], device=initialize.get_device())
                value = self.loss_for_log(loss)
                if value is not None:
                    loop.average_losses_across_data_parallel_group(value)
        self.in_fault_step = False

    def loss_for_log(self, loss: torch.Tensor) -> Optional[torch.Tensor]:
        """What this rank all-reduces when its data-parallel group averages the loss again in
        the fault's step: nothing on the skip-collective rank (a rank-dependent ``if``), the
        loss and a 1 on the mismatched-shape rank (2 elements), the 1-element loss elsewhere."""
        if self.armed and self.fault.kind == "skip-collective":
            return None
        if self.armed and self.fault.kind == "mismatched-shape":
            return torch.stack([loss, torch.ones_like(loss)])
        return loss


def inject(fault: Optional[Fault]) -> List[loop.Callback]:
    """The training-loop callbacks that put ``fault`` (:func:`fault_of`) into this process's
    run: ``[Injection]``, or ``[]`` for None. Every rank passes them to ``train``."""
    return [] if fault is None else [Injection(fault, dist.get_rank())]


# --------------------------------------------------------------------------- in the save
def kill_in_save(rank: int, iteration: int):
    """A ``torch.distributed.checkpoint`` ``StorageWriter`` for ``save_checkpoint`` (``train``'s
    ``storage_writer``): DCP's ``FileSystemWriter``, except that global rank ``rank`` exits
    (``os._exit(3)``, no Python exception) in the save of ``iteration``, right after writing
    its data file and before DCP's metadata: a rank killed mid-save, which leaves an
    incomplete checkpoint behind."""
    # heavy (about half a second): imported, and the subclass made, only for this fault
    from torch.distributed.checkpoint import FileSystemWriter
    folder = iteration_dir(".", iteration).name

    class KillInSaveWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            if dist.get_rank() != rank or pathlib.Path(self.path).name != folder:
                return future
            future.wait()
            print(f"rank {rank}: exiting in the middle of saving {folder} "
                  f"({SAVE_FAULT_ENV}={rank}:{iteration})", flush=True)
            os._exit(3)

    return KillInSaveWriter(".")   # dcp.save points it at each checkpoint folder (reset)


def kill_in_save_from_env():
    """:func:`kill_in_save` as ``MPU_LAB_FAULT_IN_SAVE=RANK:ITERATION`` asks; None (DCP's own
    writer) when it is not set."""
    value = os.environ.get(SAVE_FAULT_ENV, "")
    if not value:
        return None
    try:
        rank, iteration = (int(part) for part in value.split(":"))
    except ValueError:
        raise ValueError(f"{SAVE_FAULT_ENV}={value!r}: expected RANK:ITERATION, two integers "
                         f"(e.g. 1:4)") from None
    return kill_in_save(rank, iteration)
