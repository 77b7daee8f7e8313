"""The pipeline bubble on paper: the formula and the logical schedule.

* :func:`analytic_bubble` — Narayanan et al. 2021, §2.2.1: with ``p`` stages and ``m``
  micro-batches the bubble lasts ``(p-1)`` forward+backward slots, so bubble time / ideal time
  ``= (p-1)/m`` (GPipe and 1F1B alike); interleaving ``v`` chunks per stage (§2.2.2) makes each
  slot ``v`` times shorter: ``(p-1)/(v·m)``. As a share of the whole iteration that is
  ``(p-1)/(v·m + p-1)``.
* :func:`simulate` — the *logical* timeline: every stage runs the op list of
  :func:`~mpu_lab.perf.pipeline_order.schedule_order` (the order the real schedules
  execute, a test checks), each forward and backward of a whole stage takes one unit
  (``1/v`` for a chunk), and an op starts as soon as its stage is free and its input exists.
  Times are exact fractions, so the test can demand ``(p-1)/(m+p-1)`` exactly.
* :func:`bubble_share` — the idle share of any set of ``(kind, microbatch, chunk, start, end)``
  records, logical or measured.

A real run's clock is read from outside the mirror: :mod:`mpu_lab.perf.pipeline_timeline`
records each rank's forwards and backwards with hooks and measures its bubble, and
:mod:`mpu_lab.labkit.pipeline_parallel.viz` draws either timeline as a Gantt chart.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Dict, List, Sequence, Tuple

from mpu_lab.perf.pipeline_order import Op, schedule_order, virtual_stage
from mpu_lab.core.pipeline_parallel.partition import canonical_schedule

Record = Tuple[str, int, int, float, float]   # (kind "F"/"B", microbatch, chunk, start, end)


def analytic_bubble(pipeline_parallel_size: int, num_microbatches: int,
                    num_model_chunks: int = 1) -> Dict[str, Fraction]:
    """``relative``: bubble time / ideal compute time, ``(p-1)/(v·m)`` (the paper's figure);
    ``share``: bubble time / iteration time, ``(p-1)/(v·m + p-1)`` (what a Gantt chart shows).
    """
    p, m, v = pipeline_parallel_size, num_microbatches, num_model_chunks
    return dict(relative=Fraction(p - 1, v * m), share=Fraction(p - 1, v * m + p - 1))


@dataclasses.dataclass
class LogicalTimeline:
    """Result of :func:`simulate`. ``records[r]`` lists rank ``r``'s ops in execution order."""
    schedule: str
    pipeline_parallel_size: int
    num_microbatches: int
    num_model_chunks: int
    records: List[List[Record]]
    peak_in_flight: List[int]       # per rank: most forwards whose backward has not run yet

    @property
    def makespan(self) -> Fraction:
        return max(r[4] for recs in self.records for r in recs) - \
            min(r[3] for recs in self.records for r in recs)

    @property
    def bubble_share(self) -> Fraction:
        return bubble_share(self.records)


def _peak(ops: Sequence[Op]) -> int:
    held = peak = 0
    for op in ops:
        held += 1 if op.kind == "F" else -1
        peak = max(peak, held)
    return peak


def simulate(schedule: str, pipeline_parallel_size: int, num_microbatches: int,
             num_model_chunks: int = 1, forward_only: bool = False,
             forward_time=1, backward_time=1) -> LogicalTimeline:
    """Run every stage's op list against the data dependencies, as early as possible.

    ``forward_time`` / ``backward_time`` are the cost of a whole stage (all its layers); a
    chunk costs ``1/v`` of it. Dependencies: the forward of micro-batch ``i`` on virtual stage
    ``s`` needs that of stage ``s-1``; its backward needs the backward of stage ``s+1``, or on
    the last stage its own forward. Communication is free.
    """
    name = canonical_schedule(schedule)
    p, m, v = pipeline_parallel_size, num_microbatches, num_model_chunks
    orders = [schedule_order(name, p, r, m, v, forward_only) for r in range(p)]
    cost = {"F": Fraction(forward_time) / v, "B": Fraction(backward_time) / v}
    last = p * v - 1
    finished: Dict[Tuple[str, int, int], Fraction] = {}   # (kind, microbatch, stage) -> end
    free = [Fraction(0)] * p
    cursor = [0] * p
    records: List[List[Record]] = [[] for _ in range(p)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while cursor[r] < len(orders[r]):
                op = orders[r][cursor[r]]
                s = virtual_stage(op.chunk, r, p)
                if op.kind == "F":
                    dep = ("F", op.microbatch, s - 1) if s > 0 else None
                else:
                    dep = ("B", op.microbatch, s + 1) if s < last else ("F", op.microbatch, s)
                if dep is not None and dep not in finished:
                    break
                start = max(free[r], finished[dep]) if dep is not None else free[r]
                end = start + cost[op.kind]
                finished[(op.kind, op.microbatch, s)] = end
                records[r].append((op.kind, op.microbatch, op.chunk, start, end))
                free[r] = end
                cursor[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = {r: orders[r][cursor[r]] for r in range(p) if cursor[r] < len(orders[r])}
            raise RuntimeError(f"{name} p={p} m={m} v={v}: the op order cannot finish; "
                               f"stuck ops {waiting}")
    peaks = [0 if forward_only else _peak(o) for o in orders]
    return LogicalTimeline(name, p, m, v, records, peaks)


def bubble_share(records: Sequence[Sequence[Record]]) -> float:
    """Idle share of the iteration: ``1 - busy / (stages × (last end - first start))``."""
    starts = [r[3] for recs in records for r in recs]
    ends = [r[4] for recs in records for r in recs]
    span = max(ends) - min(starts)
    busy = sum(r[4] - r[3] for recs in records for r in recs)
    return 1 - busy / (len(records) * span)
