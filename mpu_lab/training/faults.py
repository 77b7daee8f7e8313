"""Faults injected on purpose into ``launch/train_gpt.py`` (``--inject-fault
KIND[:RANK[:ITERATION]]``), so a learner sees what a broken distributed job does and how it is
diagnosed; and the check that catches the one fault that fails nothing, silent divergence:
:func:`compare_with_dense_twin` (the run's losses against its dense TP=1 twin, ``--dense-twin``).

The lab's own (Megatron-LM has no fault injection). Each kind is something that goes wrong in
real jobs (Megatron-LM issue #881 and nanotron issue #209 are hangs):

* a collective fault (hang, skip-collective, mismatched-shape, wrong-group, pp-deadlock) makes
  the other ranks wait until the collective timeout (``MPU_LAB_TIMEOUT_S``), or makes gloo
  refuse the message, and :func:`mpu_lab.launcher.run` raises ``LaunchError`` naming where each
  rank stood;
* crash: a rank raises; the others lose their peer at once;
* divergence finishes with plausible losses: only the dense twin shows it;
* fp16-overflow finishes too: the step is skipped on every rank and the loss scale halved, as
  Megatron's dynamic loss scaler does (``skipped_iterations``, ``loss_scale`` in the metrics).

``RANK`` is a global rank (default 1) and ``ITERATION`` the 1-based iteration of the log lines
(default 2: the first step runs as usual). :func:`check_fault` says which flags a kind needs.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from mpu_lab import distributed, parallel_state

# kind -> what is injected, what a learner should take from it, which flags it needs
FAULT_KINDS: Dict[str, Dict[str, str]] = {
    "hang": {
        "what": "the rank sleeps at the start of the step instead of computing it",
        "needs": "at least 2 ranks",
        "cause": "A rank that never reaches a collective (stuck in its own code: a sleep, a "
                 "lock, slow I/O, an endless loop) leaves every other rank waiting in it until "
                 "the collective timeout."},
    "skip-collective": {
        "what": "the rank does not enter the all-reduce that averages the loss over the "
                "data-parallel group (a rank-dependent `if` around a collective)",
        "needs": "a data-parallel size > 1 (at PP > 1: a last-stage rank)",
        "cause": "A collective that not every rank calls never completes: the ranks that "
                 "entered it wait, and the rank that skipped it waits in its next one."},
    "mismatched-shape": {
        "what": "the rank all-reduces a tensor of 2 elements where the others all-reduce the "
                "1-element loss",
        "needs": "a data-parallel size > 1 (at PP > 1: a last-stage rank)",
        "cause": "Ranks that pass tensors of different sizes to the same collective cannot "
                 "agree on the message: gloo refuses it or waits until the timeout, NCCL may "
                 "hang or return garbage."},
    "wrong-group": {
        "what": "the rank sums the gradient norm over the data-parallel group where the "
                "tensor-parallel (model-parallel) group was meant",
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
                 "scaler skips the step on every rank and halves the scale, and the loss goes "
                 "on as if that iteration had not happened."},
}

DEFAULT_RANK = 1
DEFAULT_ITERATION = 2
OVERFLOW_FACTOR = 2.0 ** 64
_SPEC = "KIND[:RANK[:ITERATION]]"


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
        raise ValueError(f"--inject-fault {spec!r}: expected {_SPEC} (e.g. hang, crash:0, "
                         f"divergence:1:5); KIND is one of {valid}")
    kind = parts[0].strip().lower()
    if kind not in FAULT_KINDS:
        raise ValueError(f"--inject-fault {spec!r}: unknown fault kind {kind!r}; valid kinds "
                         f"are {valid} (format {_SPEC})")
    numbers = []
    for name, text in zip(("RANK", "ITERATION"), parts[1:]):
        try:
            numbers.append(int(text))
        except ValueError:
            raise ValueError(f"--inject-fault {spec!r}: {name} must be an integer, got "
                             f"{text!r} (format {_SPEC})") from None
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


# --------------------------------------------------------------------------- in the job
def active(state, kind: Optional[str] = None) -> Optional[Fault]:
    """The fault this rank injects in the step about to run (``state.iteration`` optimizer
    steps done), or None; with ``kind``, only a fault of that kind."""
    fault = getattr(state.args, "fault", None)
    if fault is None or (kind is not None and fault.kind != kind):
        return None
    if state.iteration + 1 != fault.iteration or dist.get_rank() != fault.rank:
        return None
    return fault


def _announce(fault: Fault) -> None:
    """One line on the faulty rank's output, with the wall clock (``time.time()``), so a test
    or a lab can measure how long the job takes to fail from here."""
    print(f"[inject-fault] {fault.kind} on rank {fault.rank} at iteration {fault.iteration} "
          f"(time {time.time():.3f})", flush=True)


def at_step_start(state) -> None:
    """Announce this rank's fault of the step (:func:`_announce`) and inject the ones that
    act before the forward: hang, divergence, pp-deadlock (on the fault's rank and its
    pipeline neighbour)."""
    fault = getattr(state.args, "fault", None)
    if fault is None or state.iteration + 1 != fault.iteration:
        return
    if dist.get_rank() == fault.rank:
        _announce(fault)
    if fault.kind == "pp-deadlock":
        _send_first_to_neighbour(state, fault)
    elif dist.get_rank() == fault.rank and fault.kind == "hang":
        time.sleep(24 * 3600)   # stopped by torchrun when the others time out
    elif dist.get_rank() == fault.rank and fault.kind == "divergence":
        _redraw_one_shard(state)


def after_backward(state) -> None:
    """crash: the rank raises between its backward and the optimizer step."""
    fault = active(state, "crash")
    if fault is not None:
        raise RuntimeError(f"rank {fault.rank} raised at iteration {fault.iteration} "
                           f"(fault injected by --inject-fault crash)")


def _redraw_one_shard(state) -> None:
    """Re-draw this rank's part of the first 2-D weight of its model from another seed."""
    weight = next(p for p in state.model.parameters() if p.dim() == 2)
    generator = torch.Generator().manual_seed(state.args.seed + 7919 * (dist.get_rank() + 1))
    fresh = torch.randn(weight.shape, generator=generator,
                        device="cpu") * state.args.init_method_std  # cpu: CPU generator
    with torch.no_grad():
        weight.copy_(fresh.to(weight.device, weight.dtype))


def _send_first_to_neighbour(state, fault: Fault) -> None:
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
    activation = torch.zeros(shape, device=distributed.get_device() if on_device else "cpu")
    dist.send(activation, dst=other, group=group)
    dist.recv(activation, src=other, group=group)


# --------------------------------------------------------------------------- dense twin
@dataclasses.dataclass
class TwinVerdict:
    """What :func:`compare_with_dense_twin` found; true when the run matches its twin."""
    ok: bool
    rtol: float
    checked: int                          # logged iterations compared
    max_rel_diff: float                   # over the iterations that matched
    iteration: Optional[int] = None       # the first logged iteration that drifts
    loss: Optional[float] = None          # the run's loss there
    dense_loss: Optional[float] = None    # the twin's
    rel_diff: Optional[float] = None

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return (f"Matches the dense twin: {self.checked} logged iterations within rtol "
                    f"{self.rtol:.0e} (largest relative difference {self.max_rel_diff:.1e}).")
        before = (f"; the {self.checked - 1} before it matched (largest relative difference "
                  f"{self.max_rel_diff:.1e})" if self.checked > 1 else "")
        return (f"Drifts from the dense twin at iteration {self.iteration}: loss "
                f"{self.loss:.6f} vs the twin's {self.dense_loss:.6f}, relative difference "
                f"{self.rel_diff:.1e} > rtol {self.rtol:.0e}{before}.")


def _rank0(metrics):
    """A job (anything with ``.results``: rank 0's report) or a report, as given."""
    return metrics.results[0] if hasattr(metrics, "results") else metrics


def compare_with_dense_twin(metrics, dense_losses: Optional[Sequence] = None,
                            rtol: float = 1e-5) -> TwinVerdict:
    """Compare a run's logged losses with its dense twin's, iteration by iteration.

    ``metrics``: the run's logged records (``job.results[0]["metrics"]``, or that result dict
    itself), each with ``iteration`` and ``lm_loss`` (the mean over the iterations since the
    previous record); ``dense_losses``: the twin's loss per iteration, iteration 1 first
    (``job.results[0]["dense_losses"]`` with ``--dense-twin``). Returns a
    :class:`TwinVerdict`: the first iteration whose relative difference exceeds ``rtol``,
    by how much; true when none does. ``metrics`` may also be the job
    (:class:`~mpu_lab.launcher.LaunchResult`); ``dense_losses`` left out: the report's own
    ``"dense_losses"``."""
    report = _rank0(metrics)
    if dense_losses is None:
        if not (isinstance(report, dict) and "dense_losses" in report):
            raise ValueError("no dense losses: run train_gpt.py with --dense-twin, or pass "
                             "dense_losses (the twin's loss per iteration)")
        dense_losses = report["dense_losses"]
    records = list(report["metrics"] if isinstance(report, dict) else report)
    if not records:
        raise ValueError("no logged iterations to compare (metrics is empty)")
    dense = [float(x["lm_loss"]) if isinstance(x, dict) else float(x) for x in dense_losses]
    previous, worst, checked = 0, 0.0, 0
    for record in records:
        it = int(record["iteration"])
        if it > len(dense):
            raise ValueError(f"the run logged iteration {it} but the twin has only "
                             f"{len(dense)} losses")
        window = dense[previous:it]
        expected = sum(window) / len(window)
        got = float(record["lm_loss"])
        rel = abs(got - expected) / abs(expected) if expected else abs(got)
        checked += 1
        if not rel <= rtol or math.isnan(got):
            return TwinVerdict(False, rtol, checked, worst, it, got, expected, rel)
        worst, previous = max(worst, rel), it
    return TwinVerdict(True, rtol, checked, worst)
