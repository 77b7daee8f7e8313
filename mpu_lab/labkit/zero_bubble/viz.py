"""Lab 12's picture: one row per pipeline rank, forwards blue, input gradients (B) orange,
weight gradients (W) green, an unsplit backward (BW) red; a V's chunk 1 lighter (lab 11's
colours for F and B, :data:`mpu_lab.labkit.pipeline_parallel.viz.GANTT_COLORS`)."""
from __future__ import annotations

from typing import Dict, List, Optional

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from mpu_lab.labkit.pipeline_parallel.viz import GANTT_COLORS
from mpu_lab.labkit.style import STYLE
from mpu_lab.perf.pipeline_schedules import Slot

COLORS = {**GANTT_COLORS, ("W", 0): "#55A868", ("W", 1): "#A1D4AE", ("BW", 0): "#C44E52",
          ("BW", 1): "#E39A9C"}
NAMES = {"F": "forward F", "B": "input gradient B", "W": "weight gradient W",
         "BW": "whole backward BW (= B + W)"}


def plot_actions(placed: Dict[int, List[Slot]], title: str, ax=None,
                 time_unit: str = "unit slots") -> Figure:
    """Chart of ``placed`` (``{rank: [Slot, ...]}``, from
    :func:`~mpu_lab.labkit.zero_bubble.timelines.unit_clock`); the box label is the
    micro-batch. Returns the ``Figure``."""
    with matplotlib.rc_context(STYLE):
        if ax is None:
            fig = Figure(figsize=(10, 0.5 * len(placed) + 1.4), dpi=100)
            ax = fig.add_subplot(1, 1, 1)
        fig = ax.figure
        span = max(float(s.end) for slots in placed.values() for s in slots)
        kinds = []
        for rank, slots in placed.items():
            y = len(placed) - 1 - rank
            for s in slots:
                x, w = float(s.start), float(s.end - s.start)
                ax.broken_barh([(x, w)], (y - 0.4, 0.8), edgecolor="white", linewidth=0.5,
                               facecolors=COLORS[(s.action.kind, s.action.chunk % 2)])
                if w / span * 800 >= 9:
                    ax.text(x + w / 2, y, str(s.action.microbatch), ha="center", va="center",
                            fontsize=7, color="white" if s.action.chunk % 2 == 0 else "black")
                if s.action.kind not in kinds:
                    kinds.append(s.action.kind)
        ax.set_yticks(range(len(placed)))
        ax.set_yticklabels([f"rank {len(placed) - 1 - i}" for i in range(len(placed))])
        ax.set_xlim(0, span)
        ax.set_xlabel(f"time ({time_unit})")
        ax.legend(handles=[Patch(color=COLORS[(k, 0)], label=NAMES[k]) for k in kinds],
                  loc="upper center", bbox_to_anchor=(0.5, -0.45 if len(placed) < 4 else -0.25),
                  ncol=len(kinds), frameon=False, fontsize=8)
        ax.set_title(title)
        fig.tight_layout()
    return fig


def plot_stack(charts: Dict[str, Dict[int, List[Slot]]], time_unit: str = "unit slots",
               width: Optional[float] = None) -> Figure:
    """Several charts one above the other, on one time axis: ``{title: placed}``."""
    rows = max(len(p) for p in charts.values())
    fig = Figure(figsize=(10, len(charts) * (0.5 * rows + 1.5)), dpi=100)
    axes = fig.subplots(len(charts), 1, squeeze=False)[:, 0]
    span = width or max(float(s.end) for p in charts.values() for sl in p.values() for s in sl)
    for ax, (title, placed) in zip(axes, charts.items()):
        plot_actions(placed, title, ax=ax, time_unit=time_unit)
        ax.set_xlim(0, span)
    return fig
