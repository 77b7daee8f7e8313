"""Lab 11's pictures: a pipeline's Gantt chart, one row per stage, from the logical timeline
(:func:`mpu_lab.perf.pipeline_simulation.simulate`) or from a real run's records
(:mod:`mpu_lab.perf.pipeline_timeline`)."""
from __future__ import annotations

from typing import Optional, Sequence

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from mpu_lab.labkit.style import STYLE
from mpu_lab.perf.pipeline_simulation import Record, bubble_share

# (kind, chunk parity) -> colour: forwards blue, backwards orange, odd model chunks lighter.
GANTT_COLORS = {("F", 0): "#4C72B0", ("F", 1): "#8DA9D6", ("B", 0): "#DD8452", ("B", 1): "#F2B994"}


def plot_gantt(records: Sequence[Sequence[Record]], title: Optional[str] = None, ax=None,
               time_unit: str = "units", label_microbatches: bool = True,
               time_limit: Optional[float] = None) -> Figure:
    """Gantt chart: one row per pipeline stage (stage 0 on top), forwards blue, backwards
    orange, odd model chunks lighter; the number in a box is its micro-batch, written wherever
    it fits inside the box (never over its neighbours); the title ends
    with the idle share (:func:`~mpu_lab.perf.pipeline_simulation.bubble_share`).

    ``records[k]`` are stage ``k``'s ``(kind, microbatch, chunk, start, end)``: ``.records`` of
    :func:`~mpu_lab.perf.pipeline_simulation.simulate`, or the ``"records"`` of
    :func:`mpu_lab.perf.pipeline_timeline.pipeline_records` (times in seconds are shifted to
    start at 0; pass ``time_unit="s"``, or ``"ms"``, which scales them by 1000). The time axis
    ends at ``time_limit`` (in ``time_unit``) when given, else at the last record; the labels
    are fitted to that axis. Returns the ``Figure`` (drawn into ``ax`` when given).
    """
    with matplotlib.rc_context(STYLE):
        if ax is None:
            fig = Figure(figsize=(10, 0.55 * len(records) + 1.3), dpi=100)
            ax = fig.add_subplot(1, 1, 1)
        else:
            fig = ax.figure
        factor = 1000.0 if time_unit == "ms" else 1.0
        t0 = min(float(r[3]) for recs in records for r in recs)
        span = (max(float(r[4]) for recs in records for r in recs) - t0) * factor
        if time_limit is not None:
            if time_limit < span:
                raise ValueError(f"time_limit {time_limit:g} {time_unit} would cut the chart, "
                                 f"whose last record ends at {span:g} {time_unit}")
            span = float(time_limit)
        px_per_unit = ax.bbox.width / span if span > 0 else 0.0    # display pixels per time unit
        for stage, recs in enumerate(records):
            y = len(records) - 1 - stage
            for kind, mb, chunk, start, end in recs:
                x, w = (float(start) - t0) * factor, (float(end) - float(start)) * factor
                ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=GANTT_COLORS[(kind, chunk % 2)],
                               edgecolor="white", linewidth=0.5)
                # a label only where it fits inside its box (7 pt digits: about 5.5 px each)
                if label_microbatches and w * px_per_unit >= 5.5 * len(str(mb)) + 3:
                    ax.text(x + w / 2, y, str(mb), ha="center", va="center", fontsize=7,
                            color="white" if chunk % 2 == 0 else "black")
        ax.set_yticks(range(len(records)))
        ax.set_yticklabels([f"stage {len(records) - 1 - i}" for i in range(len(records))])
        ax.set_xlim(0, span)
        ax.set_xlabel(f"time ({time_unit})")
        handles = [Patch(color=GANTT_COLORS[("F", 0)], label="forward"),
                   Patch(color=GANTT_COLORS[("B", 0)], label="backward")]
        if any(r[2] % 2 for recs in records for r in recs):
            handles += [Patch(color=GANTT_COLORS[("F", 1)], label="forward, odd chunk"),
                        Patch(color=GANTT_COLORS[("B", 1)], label="backward, odd chunk")]
        ax.legend(handles=handles, loc="upper center",
                  bbox_to_anchor=(0.5, -0.35 if len(records) < 4 else -0.2),
                  ncol=len(handles), frameon=False, fontsize=8)
        share = bubble_share(records)
        ax.set_title((title + " — " if title else "") + f"idle share {float(share):.1%}")
        fig.tight_layout()
    return fig


def plot_gantt_pair(top: Sequence[Sequence[Record]], bottom: Sequence[Sequence[Record]],
                    top_title: str, bottom_title: str, time_unit: str = "ms",
                    same_time_axis: bool = False) -> Figure:
    """Two Gantt charts one above the other (e.g. a measured run and a predicted one), each on
    its own time axis, or with ``same_time_axis`` both on the longer one (to compare their
    lengths; each box keeps its label only where it fits on that axis); ``time_unit`` as in
    :func:`plot_gantt`. Returns the ``Figure``."""
    rows = max(len(top), len(bottom))
    fig = Figure(figsize=(10, 2 * (0.55 * rows + 1.6)), dpi=100)
    upper, lower = fig.subplots(2, 1)
    factor = 1000.0 if time_unit == "ms" else 1.0
    limit = max(_span(top), _span(bottom)) * factor if same_time_axis else None
    plot_gantt(top, title=top_title, ax=upper, time_unit=time_unit, time_limit=limit)
    plot_gantt(bottom, title=bottom_title, ax=lower, time_unit=time_unit, time_limit=limit)
    return fig


def _span(records: Sequence[Sequence[Record]]) -> float:
    return (max(float(r[4]) for recs in records for r in recs)
            - min(float(r[3]) for recs in records for r in recs))
