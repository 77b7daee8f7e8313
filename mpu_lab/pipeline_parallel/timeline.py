"""The pipeline bubble, three ways: the formula, the logical schedule, and a real run's clock.

* :func:`analytic_bubble` — Narayanan et al. 2021, §2.2.1: with ``p`` stages and ``m``
  micro-batches the bubble lasts ``(p-1)`` forward+backward slots, so bubble time / ideal time
  ``= (p-1)/m`` (GPipe and 1F1B alike); interleaving ``v`` chunks per stage (§2.2.2) makes each
  slot ``v`` times shorter: ``(p-1)/(v·m)``. As a share of the whole iteration that is
  ``(p-1)/(v·m + p-1)``.
* :func:`simulate` — the *logical* timeline: every stage runs the op list of
  :func:`~mpu_lab.pipeline_parallel.order.schedule_order` (the list the real schedules
  execute), each forward and backward of a whole stage takes one unit (``1/v`` for a chunk),
  and an op starts as soon as its stage is free and its input exists. Times are exact
  fractions, so the test can demand ``(p-1)/(m+p-1)`` exactly.
* :func:`measured_bubble` — the same share from the ``(kind, microbatch, chunk, start, end)``
  records each rank takes during a real run (see
  :func:`~mpu_lab.pipeline_parallel.schedules.get_last_schedule_stats`). On an oversubscribed
  CPU the ranks also wait for cores, so that number is only indicative.
* :func:`plot_gantt` — the Gantt chart of either; :func:`pipeline_records` picks one
  pipeline's records out of a ``train_gpt.py --record-timeline`` job's reports.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple

from mpu_lab.pipeline_parallel.order import Op, schedule_order, virtual_stage
from mpu_lab.pipeline_parallel.partition import canonical_schedule

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


def measured_bubble(records: Sequence[Sequence[Record]], num_microbatches: int,
                    num_model_chunks: int = 1) -> Dict[str, float]:
    """The measured idle share of a real run beside the analytic one.

    ``records[r]`` are rank ``r``'s wall-clock records (one pipeline: ranks in stage order).
    Time spent waiting for a message or for a CPU core counts as idle, so on an oversubscribed
    machine the measured share is larger than the formula's — indicative only.
    """
    p = len(records)
    analytic = analytic_bubble(p, num_microbatches, num_model_chunks)
    return dict(measured_share=float(bubble_share(records)),
                analytic_share=float(analytic["share"]),
                analytic_relative=float(analytic["relative"]))


def pipeline_records(reports: Sequence[Optional[Dict]], data_parallel_rank: int = 0,
                     tensor_parallel_rank: int = 0) -> Dict:
    """One pipeline's wall-clock records out of a real run's per-rank reports.

    ``reports``: what the ranks reported, in rank order — e.g. ``job.results`` of
    ``mpu_lab.launcher.run("train_gpt.py", [..., "--record-timeline"], nproc=...)``, where each
    rank's result holds ``"timeline"`` (:func:`mpu_lab.training.schedule_timeline_report`);
    a report may also be that dict itself. Returns ``dict(records, num_microbatches,
    num_model_chunks, schedule, ranks)`` with ``records[k]`` the records of pipeline stage
    ``k`` (ready for :func:`plot_gantt` and :func:`measured_bubble`) and ``ranks[k]`` its
    global rank.
    """
    stages = {}
    for rank, report in enumerate(reports):
        entry = (report or {}).get("timeline", report) if isinstance(report, dict) else None
        if not entry or "stats" not in entry:
            continue
        if (entry["data_parallel_rank"], entry["tensor_parallel_rank"]) != \
                (data_parallel_rank, tensor_parallel_rank):
            continue
        stages[entry["pipeline_parallel_rank"]] = (rank, entry["stats"])
    if not stages:
        raise ValueError(f"no timeline for data-parallel rank {data_parallel_rank}, tensor-"
                         f"parallel rank {tensor_parallel_rank} in these reports: run with "
                         f"--record-timeline and --pipeline-model-parallel-size > 1")
    p = stages[min(stages)][1]["pipeline_parallel_size"]
    if sorted(stages) != list(range(p)):
        raise ValueError(f"timelines of pipeline stages {sorted(stages)} found, expected 0..{p - 1}")
    first = stages[0][1]
    return dict(records=[[tuple(r) for r in stages[k][1]["records"]] for k in range(p)],
                ranks=[stages[k][0] for k in range(p)], schedule=first["schedule"],
                num_microbatches=first["num_microbatches"],
                num_model_chunks=first["num_model_chunks"])


# --------------------------------------------------------------------------- the picture
_COLORS = {("F", 0): "#4C72B0", ("F", 1): "#8DA9D6", ("B", 0): "#DD8452", ("B", 1): "#F2B994"}


def plot_gantt(records: Sequence[Sequence[Record]], title: Optional[str] = None, ax=None,
               time_unit: str = "units", label_microbatches: bool = True):
    """Gantt chart: one row per pipeline stage (stage 0 on top), forwards blue, backwards
    orange, odd model chunks lighter; the number in a box is its micro-batch.

    ``records`` come from :func:`simulate` (``.records``) or from the ranks of a real run
    (times in seconds are shifted to start at 0; pass ``time_unit="s"`` or ``"ms"``, which
    scales them by 1000). Returns the matplotlib ``Figure`` (drawn into ``ax`` when given).
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = None
    if ax is None:
        fig = Figure(figsize=(10, 0.55 * len(records) + 1.3), dpi=100)
        ax = fig.add_subplot(1, 1, 1)
    else:
        fig = ax.figure
    factor = 1000.0 if time_unit == "ms" else 1.0
    t0 = min(float(r[3]) for recs in records for r in recs)
    span = (max(float(r[4]) for recs in records for r in recs) - t0) * factor
    for stage, recs in enumerate(records):
        y = len(records) - 1 - stage
        for kind, mb, chunk, start, end in recs:
            x, w = (float(start) - t0) * factor, (float(end) - float(start)) * factor
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=_COLORS[(kind, chunk % 2)],
                           edgecolor="white", linewidth=0.5)
            if label_microbatches and w > span / 60:
                ax.text(x + w / 2, y, str(mb), ha="center", va="center", fontsize=7,
                        color="white" if chunk % 2 == 0 else "black")
    ax.set_yticks(range(len(records)))
    ax.set_yticklabels([f"stage {len(records) - 1 - i}" for i in range(len(records))])
    ax.set_xlim(0, span)
    ax.set_xlabel(f"time ({time_unit})")
    handles = [Patch(color=_COLORS[("F", 0)], label="forward"),
               Patch(color=_COLORS[("B", 0)], label="backward")]
    if any(r[2] % 2 for recs in records for r in recs):
        handles += [Patch(color=_COLORS[("F", 1)], label="forward, odd chunk"),
                    Patch(color=_COLORS[("B", 1)], label="backward, odd chunk")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(records) < 4 else -0.2),
              ncol=len(handles), frameon=False, fontsize=8)
    share = bubble_share(records)
    ax.set_title((title + " — " if title else "") + f"idle share {float(share):.1%}")
    fig.tight_layout()
    return fig
