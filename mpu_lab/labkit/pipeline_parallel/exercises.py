"""Lab 11's checks: the pipeline bubble's share of an iteration, the micro-batches in flight,
and two write-the-code exercises on a live world, one rank per stage: :data:`ONE_F_ONE_B` (one
stage's 1F1B order, run with real point-to-point messages between the stages) and
:data:`ONE_F_ONE_B_LOOP` (the 1F1B loop itself, with Megatron's sends and receives, graded on
the ops it ran and on the stage gradients of a toy model)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state
from mpu_lab.labkit.verdict import Verdict, as_int, unanswered, verdict
from mpu_lab.labkit.grader import Case, Exercise, Outcome, compare
from mpu_lab.labkit.notebooks import leaks
from mpu_lab.core.pipeline_parallel import p2p_communication as p2p
from mpu_lab.core.pipeline_parallel import schedules
from mpu_lab.perf.pipeline_order import Message, Op, communication_plan, schedule_order
from mpu_lab.training.code_folder import bound_p2p
from mpu_lab.perf.pipeline_simulation import analytic_bubble, simulate
from mpu_lab.perf.pipeline_toy import (
    ToyConfig, ToyModel, build_toy_model_chunks, toy_batches, toy_forward_step)


def check_bubble_share(answer: Any, p: int, m: int, v: int = 1, tol: float = 0.005) -> Verdict:
    """The idle share of a pipeline iteration, ``(p-1)/(v·m + p-1)`` (within ``tol``)."""
    if unanswered(answer, "the bubble's share of the iteration, a number between 0 and 1"):
        return Verdict(False)
    expected = analytic_bubble(p, m, v)
    try:
        value = float(answer)
    except (TypeError, ValueError):
        value = None
    return verdict(value is not None and abs(value - float(expected["share"])) <= tol,
                    f"{expected['share']} = {float(expected['share']):.3f} of the iteration is "
                    f"idle (bubble / ideal time = (p-1)/(v m) = {expected['relative']}).",
                    f"{answer!r} is not it. Hint: the bubble lasts p-1 slots of 1/v, the work "
                    f"m slots of 1/v per stage; give bubble / (bubble + work).")


def check_peak_in_flight(answer: Any, schedule: str, p: int, m: int, stage: int = 0,
                         v: int = 1) -> Verdict:
    """Most micro-batches whose forward has run and backward not yet, on one stage."""
    if unanswered(answer, "a number of micro-batches"):
        return Verdict(False)
    expected = simulate(schedule, p, m, v).peak_in_flight[stage]
    held = "micro-batches' activations" if v == 1 else f"chunk forwards' activations (1/{v} stage each)"
    return verdict(as_int(answer) == expected,
                    f"stage {stage} holds at most {expected} {held} under {schedule} with "
                    f"p = {p}, m = {m}{'' if v == 1 else f', v = {v}'}.",
                    f"{answer!r} is not it. Hint: count the forwards a stage has run when its "
                    f"first backward starts, and whether there are that many micro-batches.")



# --------------------------------------------------------------------------- write the code
# The learner writes ``my_1f1b_order(stage, num_stages, num_microbatches)``: the list of
# ("F", k) / ("B", k) one stage runs under 1F1B. Graded live: each rank of the world is one
# stage, runs the learner's order with real sends and receives of a tiny message to its
# neighbours (a wrong order mismatches a message or deadlocks), and the list is compared with
# mpu_lab's own schedule_order("1f1b", ...).
_KINDS = ("F", "B")


def _all_stages(world_size: int) -> Tuple[int, int]:
    """The grading layout: tensor-parallel size 1, every rank one pipeline stage."""
    return 1, world_size


def num_microbatches_of(params: dict, num_stages: int) -> int:
    """A case's m, from the number of stages: ``max(1, times * p // per + plus)``."""
    return max(1, params.get("times", 0) * num_stages // params.get("per", 1) + params.get("plus", 0))


def order_text(order) -> str:
    """``[("F", 0), ("B", 0)]`` as ``F0 B0`` (anything else as its repr)."""
    try:
        return " ".join(f"{kind}{k}" for kind, k in order) or "(nothing)"
    except (TypeError, ValueError):
        return repr(order)[:200]


# what must come before each kind of op of a micro-batch: its forward before its backward, and
# (zero-bubble schedules, lab 12) its backward for the input before the one for the weights
_BEFORE = {"B": "F", "W": "B"}


def order_problem(order: Any, num_microbatches: int,
                  kinds: Sequence[str] = _KINDS) -> Optional[str]:
    """What makes ``order`` impossible for a stage (``None`` when it is a possible order): each
    ``(kind, k)`` for every kind of ``kinds`` and ``0 <= k < m`` exactly once, a backward after
    its forward (and a ``W`` after its ``B``, when ``kinds`` has one)."""
    m = num_microbatches
    shapes = [f"({kind!r}, k)" for kind in kinds]
    if not isinstance(order, (list, tuple)):
        return f"a {type(order).__name__}, not a list of {' / '.join(shapes)}"
    seen = set()
    for i, op in enumerate(order):
        if not (isinstance(op, (list, tuple)) and len(op) == 2 and op[0] in kinds
                and isinstance(op[1], int) and not isinstance(op[1], bool) and 0 <= op[1] < m):
            return (f"item {i} is {op!r}: each item is {', '.join(shapes[:-1])} or {shapes[-1]} "
                    f"with 0 <= k < m = {m}")
        op = (op[0], op[1])
        if op in seen:
            return f"{op!r} appears twice"
        before = _BEFORE.get(op[0])
        if before in kinds and (before, op[1]) not in seen:
            return f"{op!r} comes before ({before!r}, {op[1]})"
        seen.add(op)
    missing = [(kind, k) for kind in kinds for k in range(m) if (kind, k) not in seen]
    return f"{missing[:3]}{' ...' if len(missing) > 3 else ''} missing" if missing else None


def _payload(msg: Message, device) -> torch.Tensor:
    return torch.tensor([_KINDS.index(msg.kind), msg.microbatch, msg.to_stage],
                        dtype=torch.float32, device=device)


def _message_text(kind: str, microbatch: int) -> str:
    return f"the {'activation' if kind == 'F' else 'gradient'} of micro-batch {microbatch}"


def run_order(order: Sequence, stage: int, num_stages: int) -> Optional[Tuple[str, str, str]]:
    """Run ``order`` on this stage as mpu_lab's 1F1B loop does (one op per step; between two
    steps one batch of sends and receives with the neighbours: ``communication_plan``), each
    message a tiny tensor naming what it carries. Returns the first message that was not the
    one this stage needed, as ``(the op that needed it, what it needed, what came)``, or
    ``None`` when all were right; a wrong order can also leave the stages waiting for each
    other (the collective timeout then ends it)."""
    device = initialize.get_device()
    steps = [(Op(kind, k, 0),) for kind, k in order]
    problem = None
    for i, boundary in enumerate(communication_plan(steps, num_stages, stage)):
        out = {msg.kind: _payload(msg, device) for msg in boundary.sends}
        want = {msg.kind: msg for msg in boundary.recvs}
        got_prev, got_next = p2p.communicate(
            tensor_send_next=out.get("F"), tensor_send_prev=out.get("B"),
            recv_prev="F" in want, recv_next="B" in want, tensor_shape=(3,))
        for kind, got in (("F", got_prev), ("B", got_next)):
            if kind in want and problem is None and not torch.equal(got, _payload(want[kind], device)):
                problem = (f"{order[i][0]}{order[i][1]}", _message_text(kind, want[kind].microbatch),
                           _message_text(_KINDS[int(got[0])], int(got[1])))
    return problem


def run_1f1b_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank (one pipeline stage each): the learner's order for this stage, first
    checked for form (every stage learns whether all are runnable), then run with real
    messages, then compared with ``schedule_order("1f1b", ...)``."""
    p = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    m = num_microbatches_of(case.params, p)
    where = f"stage {stage} of {p}, m = {m}:"
    expected = [(op.kind, op.microbatch) for op in schedule_order("1f1b", p, stage, m)]
    error = None
    try:
        order = learner(stage, p, m)
        problem = order_problem(order, m)
    except NotImplementedError:
        raise
    except Exception as exc:       # noqa: BLE001 -- re-raised below, after the other stages know
        error, problem = exc, "raised"
    bad = torch.tensor([1.0 if problem else 0.0], device=initialize.get_device())
    torch.distributed.all_reduce(bad, group=parallel_state.get_pipeline_model_parallel_group())
    if error is not None:
        raise error
    if problem:
        return Outcome(False, f"the order of {where}", order_text(expected),
                       f"{order_text(order)} ({problem})")
    if bad.item():                 # another stage's order cannot run: that stage reports
        return Outcome(True)
    order = [(kind, int(k)) for kind, k in order]
    mismatch = run_order(order, stage, p)
    if mismatch:
        op, needed, came = mismatch
        return Outcome(False, f"{where} running your order {order_text(order)}, the message "
                       f"for {op}", needed, came)
    if order != expected:
        return Outcome(False, f"the 1F1B order of {where}", order_text(expected),
                       f"{order_text(order)} (it runs, but it is not 1F1B)")
    return Outcome(True)


ONE_F_ONE_B = Exercise(
    name="my_1f1b_order",
    run_case=run_1f1b_case,
    cases=[
        Case("m = p (as many micro-batches as stages)", dict(times=1)),
        Case("m = 2p + 1 (more micro-batches than stages)", dict(times=2, plus=1)),
        Case("m = 1", dict(plus=1)),
        Case("m = p/2 (fewer micro-batches than stages)", dict(times=1, per=2)),
    ],
    hint="a stage's first backward needs a gradient from every stage after it, so ask how far "
         "ahead it must run before that gradient can exist, and what happens when m is smaller "
         "than that. Micro-batches pass every stage in the same order. Ranks that all waited: "
         "two neighbouring stages each waited for a message the other sends later.",
    layout=_all_stages)


# --------------------------------------------------------------------------- the 1F1B loop
# The learner writes ``my_1f1b_loop(stage, num_stages, num_microbatches, forward, backward,
# p2p)``: one iteration of 1F1B on this stage, with real sends and receives (Megatron's p2p
# names, bound to the message shape). Graded live, one rank per stage, on the toy
# tied-embedding model: the ops it ran are compared with schedule_order("1f1b", ...), and the
# stage's gradients with those of mpu_lab's own 1F1B on the same weights and micro-batches
# (which the package tests hold against the single-process twin). A loop that forgets a send
# leaves a neighbour waiting: the world's collective timeout ends it, and the verdict names the
# waiting ranks.
LOOP_SEQ_LENGTH, LOOP_MICRO_BATCH = 4, 2


def loop_toy_config(num_stages: int) -> ToyConfig:
    """Two toy layers per stage, tiny sizes: the grading runs in a blink."""
    return ToyConfig(num_layers=2 * num_stages, hidden_size=8, vocab_size=16)


def _chunk(dense: ToyModel, stage: int, num_stages: int, device) -> torch.nn.Module:
    (chunk,) = build_toy_model_chunks(dense, stage, num_stages, device=device)
    with torch.no_grad():
        if chunk.post_process:          # the tied embedding's copy, as sync_embedding_weights
            chunk.word_embeddings.copy_(dense.word_embeddings)
    return chunk


class StageOps:
    """``forward(input_tensor)`` and ``backward(input_tensor, output_tensor, output_tensor_grad)``
    of one stage, as mpu_lab's ``forward_step`` / ``backward_step`` (the next micro-batch in
    turn; the last stage's output is its loss / m), noting the ops in the order they ran."""

    def __init__(self, chunk, batches, num_microbatches: int):
        self.chunk, self.data, self.m = chunk, iter(batches), num_microbatches
        self.ran: List[Tuple[str, int]] = []
        self._microbatch_of: Dict[int, int] = {}
        self._store: List = []

    def forward(self, input_tensor=None):
        k = sum(1 for kind, _ in self.ran if kind == "F")
        if k >= self.m:
            raise RuntimeError(f"forward called for a micro-batch {k}: there are only m = {self.m}")
        output = schedules.forward_step(toy_forward_step, self.data, self.chunk, self.m,
                                        input_tensor, self._store)
        self._microbatch_of[id(output)] = k
        self.ran.append(("F", k))
        return output

    def backward(self, input_tensor, output_tensor, output_tensor_grad):
        k = self._microbatch_of.pop(id(output_tensor), None)
        if k is None:
            raise RuntimeError("backward got an output_tensor that forward did not return (or "
                               "one whose backward already ran)")
        self.ran.append(("B", k))
        return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad)


def run_1f1b_loop_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank (one stage each): mpu_lab's 1F1B on one copy of the stage (the
    reference, first, so that a wrong loop's stray messages cannot reach it), then the
    learner's loop on another copy; compares the ops that ran, then the gradients."""
    p = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    m = num_microbatches_of(case.params, p)
    device = initialize.get_device()
    config = loop_toy_config(p)
    dense = ToyModel(config)
    batches = toy_batches(config, m, LOOP_SEQ_LENGTH, LOOP_MICRO_BATCH, seed=m, device=device)
    reference = _chunk(dense, stage, p, device)
    schedules.forward_backward_pipelining_without_interleaving(
        forward_step_func=toy_forward_step, data_iterator=iter(batches), model=reference,
        num_microbatches=m, seq_length=LOOP_SEQ_LENGTH, micro_batch_size=LOOP_MICRO_BATCH)
    mine = _chunk(dense, stage, p, device)
    ops = StageOps(mine, batches, m)
    shape = (LOOP_SEQ_LENGTH, LOOP_MICRO_BATCH, config.hidden_size)
    learner(stage, p, m, ops.forward, ops.backward, bound_p2p(shape))
    where = f"stage {stage} of {p}, m = {m}:"
    expected = [(op.kind, op.microbatch) for op in schedule_order("1f1b", p, stage, m)]
    if ops.ran != expected:
        return Outcome(False, f"{where} the forwards and backwards your loop ran",
                       order_text(expected), order_text(ops.ran) or "(nothing)")
    for (name, want), got in zip(reference.named_parameters(), mine.parameters()):
        outcome = compare(f"{where} the gradient of {name}", want.grad, got.grad)
        if not outcome.ok:
            return outcome
    return Outcome(True)


ONE_F_ONE_B_LOOP = Exercise(
    name="my_1f1b_loop",
    module="schedules.py",       # saved into the learner's package once right, under the name
    saves_as=("my_1f1b_loop",),  # the capstone takes for the schedule (code_folder.LAB_BUILDS)
    run_case=run_1f1b_loop_case,
    cases=ONE_F_ONE_B.cases,
    hint="each stage runs the same loop: a receive blocks until the neighbour's matching send, "
         "so every message one stage waits for must be sent by its neighbour at a point it "
         "reaches without waiting in turn. Keep the micro-batches in flight in the order they "
         "came: the gradient that comes back is always for the oldest.",
    layout=_all_stages)


# --------------------------------------------------------------------------- answers
# What lab 11's graded questions answer, for the leak check (mpu_lab.labkit.notebooks.leaks),
# from the functions the checks grade with, at the arguments the lab passes.
def _in_flight(schedule: str, p: int, m: int) -> int:
    return simulate(schedule, p, m).peak_in_flight[0]


leaks.declare_answers([
    ("11", "bubble share p=2 m=8", [analytic_bubble(2, 8)["share"]], "check_bubble_share(", 0),
    ("11", "peak in flight 1f1b", [_in_flight("1f1b", 8, 32)], "check_peak_in_flight(", 0),
    ("11", "peak in flight gpipe", [_in_flight("gpipe", 8, 32)], "check_peak_in_flight(", 1),
    ("11", "bubble share p=8 m=32", [analytic_bubble(8, 32)["share"]], "check_bubble_share(", 1),
    ("11", "bubble share p=8 m=32 v=4", [analytic_bubble(8, 32, 4)["share"]],
     "check_bubble_share(", 2),
])
