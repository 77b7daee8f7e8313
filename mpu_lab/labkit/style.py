"""What every picture of the labs shares: the fixed matplotlib style, the colours, figures made
without pyplot, and the boxes and arrows the diagrams are drawn with."""
from __future__ import annotations

import functools
from typing import List

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

# Fixed style, so pictures (and the PNGs in figures/) do not depend on a user's matplotlibrc.
STYLE = {
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.titlesize": 10,
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "hatch.linewidth": 1.0,
}
CROSSING = "#000000"   # outline and hatching of a group that leaves its box
LABEL_BOX = dict(facecolor="white", alpha=0.8, edgecolor="none", pad=1.0)


def styled(fn):
    """Run a drawing function under :data:`STYLE` (rcParams are read as artists are made)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with matplotlib.rc_context(STYLE):
            return fn(*args, **kwargs)
    return wrapper


def new_figure(width: float, height: float) -> Figure:
    """A figure of ``width`` x ``height`` inches at the labs' resolution (no pyplot state)."""
    return Figure(figsize=(width, height), dpi=STYLE["figure.dpi"])


def group_colors(n: int) -> List:
    """``n`` distinguishable colours (tab10, then tab20, then a cycle of tab20)."""
    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    size = 10 if n <= 10 else 20
    return [cmap(i % size) for i in range(n)]


def rank_colors(n: int) -> List:
    """One colour per tensor-parallel rank (the same palette in every lab)."""
    return group_colors(max(n, 1))[:n]


def display_figure(fig):
    """Show ``fig`` in IPython (a notebook cell's output); outside IPython, do nothing."""
    try:
        from IPython.display import display
    except ImportError:  # outside IPython: nothing to show on
        return
    display(fig)


def draw_block(ax, x, y, w, h, color, label="", fontsize=9, hatch=None, alpha=1.0,
               edge="#222222"):
    """A filled rectangle with ``label`` at its centre."""
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=edge, linewidth=0.9,
                           hatch=hatch, alpha=alpha))
    if label:
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=fontsize)


def draw_arrow(ax, start, end, text="", color="#333333", style="-|>", text_offset=(0, 0.12)):
    """An arrow from ``start`` to ``end`` with ``text`` above its middle."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=color,
                                 linewidth=1.2))
    if text:
        mx, my = (start[0] + end[0]) / 2 + text_offset[0], (start[1] + end[1]) / 2 + text_offset[1]
        ax.text(mx, my, text, ha="center", va="bottom", fontsize=8, color=color)

