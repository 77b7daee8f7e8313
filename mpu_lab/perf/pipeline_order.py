"""The order in which one pipeline stage runs its forwards and backwards, and the messages
between stages that this order implies. Pure: no processes, no tensors.

This module is the planner: it writes each schedule's op order down as a list, and
:func:`verify_communication` replays the messages that order implies to show that it cannot
deadlock. :mod:`~mpu_lab.core.pipeline_parallel.schedules` runs the same schedules as Megatron's
loops, independently of this list, and a multi-rank test records the order the loops execute
(from outside, with hooks) and holds it equal to :func:`schedule_order`; the logical simulator
in :mod:`~mpu_lab.perf.pipeline_simulation` replays the list, so its bubble is the real
schedule's.

The schedules (Narayanan et al. 2021, §2.2; Huang et al. 2019):

* ``gpipe`` — all forwards, then all backwards (GPipe, Huang et al. 2019, "GPipe: Efficient
  Training of Giant Neural Networks using Pipeline Parallelism"). Stage ``r`` holds the
  activations of all ``m`` micro-batches at the turn.
* ``1f1b`` — PipeDream-Flush (Narayanan et al. 2021, §2.2.1, Fig. 4 top): ``p - r - 1`` warm-up
  forwards, then one forward / one backward in turn, then the cool-down backwards. Same bubble
  as GPipe, but stage ``r`` holds at most ``p - r`` micro-batches.
* ``interleaved`` — §2.2.2, Fig. 4 bottom: each stage runs ``v`` model chunks; micro-batches
  visit the chunks in groups of ``p``. The bubble shrinks by ``v`` for ``v`` times the messages.
* ``no-pipelining`` — one stage: forward and backward of each micro-batch in turn (Megatron's
  ``forward_backward_no_pipelining``, gradient accumulation).
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Dict, List, NamedTuple, Optional, Tuple

from mpu_lab.core.pipeline_parallel.action_lists import ACTION_LIST_SCHEDULES
from mpu_lab.core.pipeline_parallel.partition import check_schedule, torch_schedule_name


class Op(NamedTuple):
    """One unit of work on a stage: ``kind`` ``"F"`` or ``"B"``, micro-batch, model chunk."""
    kind: str
    microbatch: int
    chunk: int


# --------------------------------------------------------------------------- interleaving
def interleaved_chunk_id(k: int, pipeline_parallel_size: int, num_model_chunks: int,
                         forward: bool) -> int:
    """Model chunk of the ``k``-th forward (or backward) on a stage — Megatron's
    ``get_model_chunk_id``: ``p`` micro-batches go through chunk 0, then the same ``p``
    through chunk 1, ...; backwards visit the chunks in the opposite order."""
    p, v = pipeline_parallel_size, num_model_chunks
    chunk = (k % (p * v)) // p
    return chunk if forward else v - 1 - chunk


def interleaved_microbatch_id(k: int, pipeline_parallel_size: int, num_model_chunks: int) -> int:
    """Micro-batch of the ``k``-th forward (or backward) on a stage — Megatron's
    ``get_microbatch_id_in_model_chunk``."""
    p, v = pipeline_parallel_size, num_model_chunks
    return (k // (p * v)) * p + k % p


def num_warmup_ops(schedule: str, pipeline_parallel_size: int, pipeline_parallel_rank: int,
                   num_microbatches: int, num_model_chunks: int = 1,
                   forward_only: bool = False) -> int:
    """Forwards a stage runs before its first backward (Megatron's ``num_warmup_microbatches``).

    1F1B: ``p - r - 1`` — just enough that the last stage can start its first backward at once.
    Interleaved: ``2(p - r - 1) + (v - 1)p`` (all ``m·v`` when ``m == p``).
    """
    p, r, m, v = pipeline_parallel_size, pipeline_parallel_rank, num_microbatches, num_model_chunks
    total = m * v
    if forward_only or schedule == "gpipe":
        return total
    if schedule == "no-pipelining":
        return 0
    if schedule == "1f1b":
        return min(p - r - 1, m)
    if m == p:   # Megatron: all_warmup_microbatches
        return total
    return min((p - r - 1) * 2 + (v - 1) * p, total)


def schedule_steps(schedule: str, pipeline_parallel_size: int, pipeline_parallel_rank: int,
                   num_microbatches: int, num_model_chunks: int = 1,
                   forward_only: bool = False) -> List[Tuple[Op, ...]]:
    """The stage's ops grouped into *steps*. A stage communicates only between steps — it
    sends what the step produced and receives what the next step needs in one batch.

    Plain 1F1B communicates after every op, as Megatron's ``forward_backward_pipelining_without_
    interleaving`` does: the forward of micro-batch k + warm-up, then ``send_forward_recv_backward``,
    then the backward of k, then ``send_backward_recv_forward``. Waiting for the backward's
    gradient only after the forward has run lets that forward overlap the next stage's work (at
    p = 2, m = 2 grouping them would stretch the step from 3 to 4 (f + b) units).
    The interleaved schedule pairs a steady-state forward with a backward in one step, as
    Megatron's ``send_forward_backward_recv_forward_backward`` does: communicating after each op
    there deadlocks (see :func:`verify_communication`).
    """
    p, r, m, v = pipeline_parallel_size, pipeline_parallel_rank, num_microbatches, num_model_chunks
    name = check_schedule(schedule, p, m, v)
    if torch_schedule_name(name) in ACTION_LIST_SCHEDULES:
        raise ValueError(f"the planner writes out the loops (GPipe, 1F1B, Interleaved1F1B), not "
                         f"{schedule!r}: its order is the action list of mpu_lab.core."
                         f"pipeline_parallel.action_lists.pipeline_actions, its idle slots "
                         f"mpu_lab.perf.pipeline_schedules.idle_slots")
    if not 0 <= r < p:
        raise ValueError(f"pipeline rank {r} is outside 0..{p - 1}")
    if name == "no-pipelining":
        return [(Op("F", i, 0),) if forward_only else (Op("F", i, 0), Op("B", i, 0))
                for i in range(m)]
    if name == "interleaved":
        def fwd(k):
            return Op("F", interleaved_microbatch_id(k, p, v), interleaved_chunk_id(k, p, v, True))

        def bwd(k):
            return Op("B", interleaved_microbatch_id(k, p, v), interleaved_chunk_id(k, p, v, False))
    else:
        def fwd(k):
            return Op("F", k, 0)

        def bwd(k):
            return Op("B", k, 0)
    total = m * v
    warmup = num_warmup_ops(name, p, r, m, v, forward_only)
    steps = [(fwd(k),) for k in range(warmup)]
    if forward_only:
        return steps
    steady = total - warmup
    # 1F1B steady state: the forward of micro-batch k + warmup, then the backward of k.
    if name == "interleaved":
        steps += [(fwd(warmup + i), bwd(i)) for i in range(steady)]
    else:
        steps += [step for i in range(steady) for step in ((fwd(warmup + i),), (bwd(i),))]
    steps += [(bwd(k),) for k in range(steady, total)]   # cool-down
    return steps


def schedule_order(schedule: str, pipeline_parallel_size: int, pipeline_parallel_rank: int,
                   num_microbatches: int, num_model_chunks: int = 1,
                   forward_only: bool = False) -> List[Op]:
    """Every forward and backward one stage runs, in order (the flattened steps).

    >>> "".join(o.kind + str(o.microbatch) for o in schedule_order("1f1b", 4, 0, 6))
    'F0F1F2F3B0F4B1F5B2B3B4B5'
    >>> "".join(o.kind + str(o.microbatch) for o in schedule_order("gpipe", 4, 0, 3))
    'F0F1F2B0B1B2'
    """
    steps = schedule_steps(schedule, pipeline_parallel_size, pipeline_parallel_rank,
                           num_microbatches, num_model_chunks, forward_only)
    return [op for step in steps for op in step]


# --------------------------------------------------------------------------- messages
class Message(NamedTuple):
    """An activation (``kind="F"``) or gradient (``"B"``) for ``microbatch`` that enters
    virtual stage ``to_stage``; it travels between pipeline ranks ``src`` and ``dst``."""
    kind: str
    microbatch: int
    to_stage: int
    src: int
    dst: int


class Boundary(NamedTuple):
    """One batch of point-to-point messages a stage posts between two steps and waits for:
    it sends what the step before produced and receives what the step after needs (Megatron's
    ``send_forward_recv_backward`` & co.). Within each tuple activations come before gradients,
    so that with ``p = 2`` — where the next and the previous rank are the same rank — both
    ranks list the messages between them in the same order."""
    sends: Tuple[Message, ...]
    recvs: Tuple[Message, ...]


def virtual_stage(chunk: int, pipeline_parallel_rank: int, pipeline_parallel_size: int) -> int:
    return chunk * pipeline_parallel_size + pipeline_parallel_rank


def output_message(op: Op, pipeline_parallel_size: int, pipeline_parallel_rank: int,
                   num_model_chunks: int = 1) -> Optional[Message]:
    """What ``op`` sends on: its activation to the next virtual stage (next rank; the last rank's
    chunk ``k`` feeds rank 0's chunk ``k+1``) or its input gradient to the previous one."""
    p, r = pipeline_parallel_size, pipeline_parallel_rank
    s, last = virtual_stage(op.chunk, r, p), p * num_model_chunks - 1
    if op.kind == "F":
        return Message("F", op.microbatch, s + 1, r, (r + 1) % p) if s < last else None
    return Message("B", op.microbatch, s - 1, r, (r - 1) % p) if s > 0 else None


def input_message(op: Op, pipeline_parallel_size: int, pipeline_parallel_rank: int,
                  num_model_chunks: int = 1) -> Optional[Message]:
    """What ``op`` needs from a neighbour (None on the first stage's forward — it reads the
    data — and on the last stage's backward — it starts from its own loss)."""
    p, r = pipeline_parallel_size, pipeline_parallel_rank
    s, last = virtual_stage(op.chunk, r, p), p * num_model_chunks - 1
    if op.kind == "F":
        return Message("F", op.microbatch, s, (r - 1) % p, r) if s > 0 else None
    return Message("B", op.microbatch, s, (r + 1) % p, r) if s < last else None


def communication_plan(steps: List[Tuple[Op, ...]], pipeline_parallel_size: int,
                       pipeline_parallel_rank: int, num_model_chunks: int = 1) -> List[Boundary]:
    """``len(steps) + 1`` boundaries: boundary ``i`` comes before step ``i``, the last one
    after all steps."""
    p, r, v = pipeline_parallel_size, pipeline_parallel_rank, num_model_chunks
    kind_order = {"F": 0, "B": 1}
    plan = []
    for i in range(len(steps) + 1):
        sends = [output_message(op, p, r, v) for op in steps[i - 1]] if i > 0 else []
        recvs = [input_message(op, p, r, v) for op in steps[i]] if i < len(steps) else []
        plan.append(Boundary(tuple(sorted((m for m in sends if m), key=lambda m: kind_order[m.kind])),
                             tuple(sorted((m for m in recvs if m), key=lambda m: kind_order[m.kind]))))
    return plan


def verify_communication(schedule: str, pipeline_parallel_size: int, num_microbatches: int,
                         num_model_chunks: int = 1, forward_only: bool = False,
                         one_op_per_step: bool = False) -> int:
    """Replay every stage's boundaries under the strictest point-to-point rules and raise
    ``RuntimeError`` on a deadlock or a mismatched message. Returns the number of messages.

    The rules are NCCL's: a send completes only once the peer has posted the matching receive
    (rendezvous), messages between two ranks are matched in the order they were posted
    (tags ignored — with ``p = 2`` both directions share one pair of ranks), and a stage waits
    for its whole batch before it computes on.

    ``one_op_per_step=True`` communicates after every single op instead of after each step:
    that deadlocks the interleaved schedule (try it), which is why the steady state pairs a
    forward with a backward.
    """
    p, m, v = pipeline_parallel_size, num_microbatches, num_model_chunks
    plans = []
    for r in range(p):
        steps = schedule_steps(schedule, p, r, m, v, forward_only)
        if one_op_per_step:
            steps = [(op,) for step in steps for op in step]
        plans.append(communication_plan(steps, p, r, v))
    position = [0] * p                          # index of the boundary each rank is waiting in
    done: Dict[Tuple[int, int], set] = {}       # (rank, boundary) -> completed sides
    sends: Dict[Tuple[int, int], deque] = defaultdict(deque)   # (src, dst) -> posted sends
    recvs: Dict[Tuple[int, int], deque] = defaultdict(deque)   # (src, dst) -> posted receives

    def post(rank):
        b = position[rank]
        if b >= len(plans[rank]):
            return
        boundary = plans[rank][b]
        done[(rank, b)] = set()
        for msg in boundary.sends:
            sends[(rank, msg.dst)].append((msg, rank, b))
        for msg in boundary.recvs:
            recvs[(msg.src, rank)].append((msg, rank, b))

    for rank in range(p):
        post(rank)
    matched = 0
    progress = True
    while progress:
        progress = False
        for key in list(sends):
            while sends[key] and recvs[key]:
                (sent, s_rank, s_b), (want, r_rank, r_b) = sends[key].popleft(), recvs[key].popleft()
                if sent != want:
                    raise RuntimeError(f"{schedule} p={p} m={m} v={v}: rank {r_rank} expects "
                                       f"{want} but rank {s_rank} sends {sent} first")
                done[(s_rank, s_b)].add(("send", sent))
                done[(r_rank, r_b)].add(("recv", want))
                matched += 1
                progress = True
        for rank in range(p):
            while position[rank] < len(plans[rank]):
                b = position[rank]
                need = {("send", msg) for msg in plans[rank][b].sends} | \
                       {("recv", msg) for msg in plans[rank][b].recvs}
                if not need <= done[(rank, b)]:
                    break
                position[rank] += 1
                post(rank)
                progress = True
    stuck = [r for r in range(p) if position[r] < len(plans[r])]
    if stuck:
        detail = "; ".join(f"rank {r} waits in {plans[r][position[r]]}" for r in stuck)
        raise RuntimeError(f"{schedule} p={p} m={m} v={v} deadlocks: {detail}")
    return matched
