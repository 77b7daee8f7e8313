"""Lab 10's pictures: the ring of context-parallel attention step by step, and the causal work
per rank of a contiguous split against Megatron's zig-zag layout.

Both read :mod:`mpu_lab.labkit.context_parallel.lessons`, which takes the block pairs from the mirror's
``block_pair`` (:mod:`mpu_lab.core.context_parallel.ring_attention`).
"""
from __future__ import annotations

from typing import List

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from mpu_lab.labkit.context_parallel import lessons as cp_lessons
from mpu_lab.labkit.style import new_figure, rank_colors

# cell states of the score matrix, in the colour map's order
_EMPTY, _DONE, _NOW, _MASKED, _SKIPPED = range(5)
_COLORS = ["#ffffff", "#b9d3ee", "#2b6cb0", "#c8c8c8", "#f4b6b6"]
_LABELS = ["not this rank's queries", "computed at an earlier step", "computed at this step",
           "masked inside the block (key after query)", "held, never computed (all in the future)"]


def ring_step_grid(schedule: List[List[dict]], seq_length: int, rank: int, step: int) -> np.ndarray:
    """The ``[s, s]`` score matrix (queries down, keys across, natural order) of CP rank
    ``rank`` after ring step ``step``, each cell a state: empty, computed earlier, computed now,
    masked inside the block, or held but skipped."""
    grid = np.full((seq_length, seq_length), _EMPTY)
    for earlier in schedule[rank][:step]:
        for q, k in earlier["computed"]:
            grid[q, k] = _DONE
    now = schedule[rank][step]
    computed = set(now["computed"])
    mine = cp_lessons.positions(seq_length, rank, len(schedule), "zig-zag")
    for q in mine:
        for k in now["held"]:
            if (q, k) in computed:
                grid[q, k] = _NOW
            elif q in now["queries"] and k in now["keys"]:
                grid[q, k] = _MASKED
            else:
                grid[q, k] = _SKIPPED
    return grid


def plot_ring_steps(cp: int, seq_length: int) -> Figure:
    """One panel per CP rank (rows) and ring step (columns): the whole ``s x s`` causal score
    matrix, the rank's query rows, and which pairs of the K/V block it holds at that step it
    computes, masks or skips (Megatron's layout; the mirror's ring)."""
    schedule = cp_lessons.ring_schedule(cp, seq_length)
    size = 1.9 if cp <= 4 else 1.2
    fig = new_figure(max(7.0, size * cp + 0.6), size * cp + 1.3)
    axes = fig.subplots(cp, cp, squeeze=False)
    cmap = ListedColormap(_COLORS)
    for rank in range(cp):
        for step in range(cp):
            ax = axes[rank, step]
            ax.imshow(ring_step_grid(schedule, seq_length, rank, step), cmap=cmap, vmin=0,
                      vmax=len(_COLORS) - 1, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            for side in ax.spines.values():
                side.set_edgecolor(rank_colors(cp)[rank])
            st = schedule[rank][step]
            ax.set_title(f"rank {rank}, step {step}: K/V of {st['kv_rank']}", fontsize=8)
            if step == 0:
                ax.set_ylabel("queries", fontsize=8)
            if rank == cp - 1:
                ax.set_xlabel("keys", fontsize=8)
    fig.legend(handles=[Patch(facecolor=c, edgecolor="#888888", label=t)
                        for c, t in zip(_COLORS[1:], _LABELS[1:])],
               loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(f"Ring attention, s = {seq_length}, cp = {cp} (zig-zag layout): score matrix "
                 f"per rank and step", x=0.02, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 0.97))
    return fig


def plot_causal_work(seq_length: int, cp: int) -> Figure:
    """Left: which positions each rank holds, contiguous and zig-zag. Right: each rank's causal
    (query, key) pairs in both layouts."""
    fig = new_figure(10, 3.2)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.4, 1]})
    colors = rank_colors(cp)
    for row, layout in enumerate(cp_lessons.LAYOUTS):
        for rank in range(cp):
            for p in cp_lessons.positions(seq_length, rank, cp, layout):
                left.add_patch(_cell(p, row, colors[rank]))
    left.set_xlim(0, seq_length)
    left.set_ylim(-0.1, 2)
    left.set_yticks([0.4, 1.4], list(cp_lessons.LAYOUTS))
    left.set_xlabel("sequence position (colour: the CP rank that holds it)")
    left.invert_yaxis()
    width = 0.38
    x = np.arange(cp)
    for k, layout in enumerate(cp_lessons.LAYOUTS):
        work = cp_lessons.causal_work(seq_length, cp, layout)
        right.bar(x + (k - 0.5) * width, work, width, label=layout,
                  color=["#999999", "#2b6cb0"][k])
    right.set_xticks(x, [f"rank {r}" for r in range(cp)])
    right.set_ylabel("causal (query, key) pairs")
    right.legend(frameon=False, fontsize=8)
    for ax in (left, right):
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    fig.suptitle(f"s = {seq_length}, cp = {cp}: who holds what, and the attention work that "
                 f"follows", x=0.02, ha="left", fontsize=10)
    fig.tight_layout()
    return fig


def _cell(position: int, row: int, color) -> Rectangle:
    return Rectangle((position, row), 1, 0.8, facecolor=color, edgecolor="white", linewidth=0.5)
