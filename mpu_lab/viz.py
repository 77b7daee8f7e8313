"""Pictures and small views for the labs, and the figures in ``figures/``.

Every ``plot_*`` function builds and returns a :class:`matplotlib.figure.Figure` without touching
pyplot's global state: a notebook shows it by ending a cell with it, a script saves it
(:func:`save_figures`, run by ``python -m mpu_lab.notebooks figures``), a test inspects it.
The ``show_*`` / ``print_*`` functions print plain text in a fixed order (what nbval compares).

What is drawn where:

* lab 01 — :func:`plot_rank_grid`, :func:`plot_group_families` (GPUs in boxes of
  ``gpus_per_node``, coloured by group; groups that leave a box are hatched, thick outline),
  :func:`format_groups` (the MPU walkthrough's tables), :func:`show_rank_groups` and its
  ipywidgets front end :func:`interactive_rank_groups`;
* labs 02/03 — :func:`shard_shapes`, :func:`print_shard_shapes`, :func:`strided_owners`,
  :func:`plot_column_split`, :func:`plot_row_split`, :func:`plot_fg` (Megatron-LM §3, Fig. 3);
* lab 04 — :func:`plot_collective`: each rank's tensor before and after a collective;
* lab 05 — :func:`plot_transformer_layer` (f and g, or the sequence-parallel all-gather and
  reduce-scatter, around both blocks of a layer), :func:`plot_activation_memory`;
* lab 07 — :func:`plot_loss_curves` (curves that should coincide, their relative
  differences, a checkpoint line) and :class:`LiveLossPlot` (redrawn while a job runs).
"""
from __future__ import annotations

import pathlib
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from mpu_lab import parallel_state

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
_LABEL_BOX = dict(facecolor="white", alpha=0.8, edgecolor="none", pad=1.0)
FAMILY_NAMES = {
    "tp": "tensor model-parallel", "pp": "pipeline model-parallel", "dp": "data_parallel",
    "cp": "context-parallel", "tp-pp": "model-parallel", "dp-cp": "data+context-parallel",
    "tp-dp": "tensor+data-parallel", "tp-cp": "tensor+context-parallel",
    "tp-dp-cp": "tensor+data+context-parallel", "embedding": "embedding",
    "position-embedding": "position-embedding",
}
# Order in which show_rank_groups lists families: the walkthrough's first (dp, tp, pp).
SHOWN_FAMILIES = ("dp", "tp", "pp", "cp", "tp-pp")


def _styled(fn):
    """Run a drawing function under :data:`STYLE` (rcParams are read as artists are made)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with matplotlib.rc_context(STYLE):
            return fn(*args, **kwargs)
    return wrapper


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), dpi=STYLE["figure.dpi"])


def group_colors(n: int) -> List:
    """``n`` distinguishable colours (tab10, then tab20, then a cycle of tab20)."""
    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    size = 10 if n <= 10 else 20
    return [cmap(i % size) for i in range(n)]


def rank_colors(n: int) -> List:
    """One colour per tensor-parallel rank (the same palette in every lab)."""
    return group_colors(max(n, 1))[:n]


# --------------------------------------------------------------------------- lab 01: groups
def node_of(rank: int, gpus_per_node: int) -> int:
    """The box (node) that holds ``rank`` when ranks fill boxes in order, as torchrun does."""
    return rank // gpus_per_node


def groups_crossing_nodes(groups: Sequence[Sequence[int]], gpus_per_node: int) -> List[List[int]]:
    """The groups whose ranks do not all sit in one box of ``gpus_per_node`` GPUs."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    return [list(g) for g in groups if len({node_of(r, gpus_per_node) for r in g}) > 1]


def format_groups(groups: Dict[str, List[List[int]]], families: Iterable[str] = ("dp", "tp", "pp")
                  ) -> str:
    """The MPU walkthrough's listing: ``8 data_parallel groups:`` then ``[g0, g2], [g1, g3], ...``."""
    lines = []
    for fam in families:
        listed = ", ".join("[" + ", ".join(f"g{r}" for r in g) + "]" for g in groups[fam])
        lines.append(f" {len(groups[fam])} {FAMILY_NAMES.get(fam, fam)} groups:")
        lines.append(f" {listed}")
    return "\n".join(lines)


@_styled
def plot_rank_grid(groups: Sequence[Sequence[int]], world_size: int, gpus_per_node: int = 8,
                   title: str = "", ax=None):
    """Draw ``world_size`` GPUs, ``gpus_per_node`` to a box, coloured by their group.

    Each square shows the rank (``g5``) and, below it, the index of its group. Groups whose
    members sit in more than one box are hatched and outlined in black. Returns the Axes.
    """
    if ax is None:
        height = 0.9 * _nodes(world_size, gpus_per_node) + 0.8
        ax = _figure(max(4.0, 0.75 * gpus_per_node + 1), height).add_subplot()
    nodes = _nodes(world_size, gpus_per_node)
    index = {r: i for i, g in enumerate(groups) for r in g}
    colors = group_colors(len(groups))
    crossing = {r for g in groups_crossing_nodes(groups, gpus_per_node) for r in g}
    for node in range(nodes):
        y = nodes - 1 - node   # node 0 on top
        ax.add_patch(FancyBboxPatch((-0.12, y - 0.1), gpus_per_node + 0.24 - 0.0, 0.86,
                                    boxstyle="round,pad=0.02,rounding_size=0.08",
                                    facecolor="#f4f4f4", edgecolor="#555555", linewidth=1.2))
        first, last = node * gpus_per_node, min(world_size, (node + 1) * gpus_per_node) - 1
        ax.text(-0.3, y + 0.33, f"node {node}\nranks {first}-{last}", ha="right", va="center",
                fontsize=8, color="#333333")
        for slot in range(gpus_per_node):
            rank = node * gpus_per_node + slot
            if rank >= world_size:
                continue
            face = colors[index[rank]] if rank in index else "white"
            ax.add_patch(Rectangle((slot + 0.06, y), 0.88, 0.66, facecolor=face,
                                   edgecolor=CROSSING if rank in crossing else "#222222",
                                   linewidth=2.6 if rank in crossing else 0.8,
                                   hatch="///" if rank in crossing else None))
            ax.text(slot + 0.5, y + 0.43, f"g{rank}", ha="center", va="center", fontsize=9,
                    fontweight="bold", bbox=_LABEL_BOX if rank in crossing else None)
            if rank in index:
                ax.text(slot + 0.5, y + 0.15, f"#{index[rank]}", ha="center", va="center",
                        fontsize=7)
    ax.set_xlim(-2.0, gpus_per_node + 0.3)
    ax.set_ylim(-0.25, nodes)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left")
    return ax


def _nodes(world_size: int, gpus_per_node: int) -> int:
    return -(-world_size // gpus_per_node)


def describe_crossings(groups: Dict[str, List[List[int]]], gpus_per_node: int,
                       families: Iterable[str] = ("tp", "dp", "pp")) -> str:
    """One line per family: how many of its groups leave their box, and which."""
    lines = []
    for fam in families:
        cross = groups_crossing_nodes(groups[fam], gpus_per_node)
        which = "" if not cross else ": " + ", ".join(str(g) for g in cross[:4]) + \
            (", ..." if len(cross) > 4 else "")
        lines.append(f"{fam:>3} groups crossing a node boundary: {len(cross)} of "
                     f"{len(groups[fam])}{which}")
    return "\n".join(lines)


@_styled
def plot_group_families(world_size: int = 16, tp: int = 2, pp: int = 4, cp: int = 1,
                        order: str = parallel_state.DEFAULT_ORDER, gpus_per_node: int = 8,
                        families: Sequence[str] = ("tp", "dp", "pp")) -> Figure:
    """One panel per group family (tensor, data, pipeline by default) of the same world."""
    groups = parallel_state.generate_rank_groups(world_size, tp, pp, cp, order)
    nodes = _nodes(world_size, gpus_per_node)
    width = max(5.5, 0.8 * gpus_per_node + 2.2)
    fig = _figure(width, len(families) * (0.85 * nodes + 0.55) + 0.4)
    axes = fig.subplots(len(families), 1, squeeze=False)[:, 0]
    for ax, fam in zip(axes, families):
        cross = len(groups_crossing_nodes(groups[fam], gpus_per_node))
        title = (f"{FAMILY_NAMES.get(fam, fam)} groups ({fam}): {len(groups[fam])} groups of "
                 f"{len(groups[fam][0])}; {cross} cross a node boundary"
                 + (" (hatched)" if cross else ""))
        plot_rank_grid(groups[fam], world_size, gpus_per_node, title=title, ax=ax)
    dp = world_size // (tp * pp * cp)
    fig.suptitle(f"n={world_size} GPUs, {gpus_per_node} per node: t={tp}, p={pp}, c={cp}, "
                 f"d={dp}, order {order!r}", x=0.02, ha="left", fontsize=11)
    fig.tight_layout()
    return fig


def show_rank_groups(world_size: int = 16, tp: int = 2, pp: int = 4, cp: int = 1,
                     order: str = parallel_state.DEFAULT_ORDER, gpus_per_node: int = 8,
                     draw: bool = True) -> None:
    """Print the groups of one configuration and draw them — the body of lab 01's widget.

    A configuration that does not tile the world prints the reason instead of raising, so
    the interactive view keeps working while a learner moves the sliders. Returns None (so
    neither ``interact`` nor a notebook cell shows the figure a second time).
    """
    try:
        groups = parallel_state.generate_rank_groups(world_size, tp, pp, cp, order)
    except ValueError as exc:
        print(f"not a valid configuration: {exc}")
        return None
    dp = world_size // (tp * pp * cp)
    print(f"n = {world_size} = t*p*c*d = {tp}*{pp}*{cp}*{dp}   (order {order!r}, "
          f"{gpus_per_node} GPUs per node)")
    families = [f for f in SHOWN_FAMILIES if f != "cp" or cp > 1]
    print(format_groups(groups, families))
    basic = [f for f in ("tp", "cp", "dp", "pp") if f in families]
    print(describe_crossings(groups, gpus_per_node, basic))
    if not draw:
        return None
    fig = plot_group_families(world_size, tp, pp, cp, order, gpus_per_node,
                              families=basic)
    _display(fig)


def _display(fig):
    try:
        from IPython.display import display
    except ImportError:  # outside IPython: nothing to show on
        return
    display(fig)


def interactive_rank_groups(world_size: int = 16, tp: int = 2, pp: int = 4, cp: int = 1,
                            order: str = parallel_state.DEFAULT_ORDER, gpus_per_node: int = 8
                            ) -> None:
    """ipywidgets sliders for :func:`show_rank_groups` (world size, t, p, c, order, box size)."""
    import ipywidgets as widgets

    orders = ["tp-cp-dp-pp", "tp-cp-pp-dp", "tp-pp-dp", "dp-tp-pp", "pp-dp-tp"]
    if order not in orders:
        orders.insert(0, order)
    widgets.interact(
        show_rank_groups,
        world_size=widgets.IntSlider(value=world_size, min=1, max=64, description="world size"),
        tp=widgets.IntSlider(value=tp, min=1, max=16, description="tp"),
        pp=widgets.IntSlider(value=pp, min=1, max=16, description="pp"),
        cp=widgets.IntSlider(value=cp, min=1, max=8, description="cp"),
        order=widgets.Dropdown(options=orders, value=order, description="order"),
        gpus_per_node=widgets.IntSlider(value=gpus_per_node, min=1, max=16,
                                        description="GPUs/node"),
        draw=widgets.fixed(True),
    )   # interact displays the sliders itself; returning None keeps the cell output clean


# --------------------------------------------------------------------------- labs 02/03: splits
def shard_shapes(kind: str, input_size: int, output_size: int, parts: int) -> List[tuple]:
    """Shapes of ``A``'s pieces (``A`` is ``[input_size, output_size]``, ``Y = X A``).

    ``kind="column"`` cuts the columns (``A_i: [in, out/parts]``), ``"row"`` the rows
    (``A_i: [in/parts, out]``). The pieces are real ``torch.split`` views of a full matrix,
    the way Megatron slices its master weight; ``parts`` must divide the cut dimension.
    """
    import torch

    if kind not in ("column", "row"):
        raise ValueError(f"kind must be 'column' or 'row', got {kind!r}")
    cut = output_size if kind == "column" else input_size
    if parts < 1 or cut % parts:
        raise ValueError(f"{kind} split: {cut} is not divisible into {parts} equal parts")
    master_a = torch.empty(input_size, output_size)             # A = W^T, [in, out]
    dim = 1 if kind == "column" else 0
    return [tuple(p.shape) for p in torch.split(master_a, cut // parts, dim=dim)]


def print_shard_shapes(kind: str, input_size: int, output_size: int, parts: int) -> None:
    """Print the pieces as the MPU walkthrough does: ``A = [`` ``A0= torch.Size([...]),`` ... ``]``."""
    shapes = shard_shapes(kind, input_size, output_size, parts)
    print("A = [")
    print(", ".join(f"A{i}= torch.Size({list(s)})" for i, s in enumerate(shapes)))
    print(" ]")
    print(f"{len(shapes)} pieces")


def strided_owners(size: int, tp: int, stride: int) -> List[int]:
    """Which tensor-parallel rank owns each row of a fused ``[size, ...]`` weight with ``stride``.

    Megatron cuts the master weight into ``tp * stride`` pieces of ``size / (tp * stride)``
    rows and gives rank ``r`` pieces ``r, r + tp, r + 2 tp, ...``: with ``[Q; K; V]`` fused
    (``stride=3``) every rank gets its slice of Q, of K and of V.
    """
    if size % (tp * stride):
        raise ValueError(f"{size} rows cannot be cut into tp*stride = {tp}*{stride} equal pieces")
    piece = size // (tp * stride)
    return [(row // piece) % tp for row in range(size)]


def _block(ax, x, y, w, h, color, label="", fontsize=9, hatch=None, alpha=1.0, edge="#222222"):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=edge, linewidth=0.9,
                           hatch=hatch, alpha=alpha))
    if label:
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, start, end, text="", color="#333333", style="-|>", text_offset=(0, 0.12)):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=color,
                                 linewidth=1.2))
    if text:
        mx, my = (start[0] + end[0]) / 2 + text_offset[0], (start[1] + end[1]) / 2 + text_offset[1]
        ax.text(mx, my, text, ha="center", va="bottom", fontsize=8, color=color)


@_styled
def plot_column_split(input_size: int = 1024, output_size: int = 512, tp: int = 2,
                      stride: int = 1) -> Figure:
    """``Y = X A`` with ``A`` cut by columns: rank ``i`` holds ``A_i`` and computes ``Y_i``.

    With ``stride > 1`` (a fused weight such as ``[Q K V]``) the columns are cut into
    ``tp * stride`` pieces dealt out round-robin, so each rank owns one piece of every part.
    """
    owners = strided_owners(output_size, tp, stride)
    colors = rank_colors(tp)
    pieces = tp * stride
    fig = _figure(10.5, 3.7)
    ax = fig.add_subplot()
    # Geometry (drawing units): X is [b, in], A is [in, out], Y is [b, out].
    in_h, out_w, b_h = 2.4, 3.0, 1.0
    x0, a0, y0 = 0.0, 3.2, 7.4
    _block(ax, x0, 1.4, 2.4, b_h, "#d9d9d9", f"X\n[b, {input_size}]\nsame on every rank")
    ax.text(2.8, 1.9, "x", fontsize=16, ha="center", va="center")
    w = out_w / pieces
    for p in range(pieces):
        rank = owners[p * (output_size // pieces)]
        label = f"A{rank}" if stride == 1 else f"r{rank}"
        _block(ax, a0 + p * w, 0.2, w, in_h, colors[rank], label)
    ax.text(a0 + out_w / 2, 2.75, f"A [{input_size}, {output_size}], cut by columns", ha="center",
            fontsize=9)
    ax.text(6.8, 1.9, "=", fontsize=16, ha="center", va="center")
    for p in range(pieces):
        rank = owners[p * (output_size // pieces)]
        _block(ax, y0 + p * w, 1.4, w, b_h, colors[rank], f"Y{rank}" if stride == 1 else "")
    ax.text(y0 + out_w / 2, 2.55, f"Y [b, {output_size}]", ha="center", fontsize=9)
    shard = f"[{input_size}, {output_size // tp}]"
    note = (f"t = {tp}: rank i keeps A_i {shard} (stored as weight [{output_size // tp}, "
            f"{input_size}]) and computes Y_i = X A_i [b, {output_size // tp}]; "
            f"gather_output=True all-gathers Y = [Y_0 ... Y_{tp - 1}]")
    if stride > 1:
        note = (f"stride = {stride}: {pieces} pieces of {output_size // pieces} columns dealt out "
                f"round-robin; rank r keeps pieces r, r+{tp}, ... (its slice of each fused part)")
    ax.text(0, -0.35, note, fontsize=8, va="top")
    ax.set_xlim(-0.2, 10.6)
    ax.set_ylim(-0.8, 3.0)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("Column-parallel linear (Megatron-LM section 3): A = [A_0, ..., A_{t-1}]",
                 loc="left")
    fig.tight_layout()
    return fig


@_styled
def plot_row_split(input_size: int = 1024, output_size: int = 512, tp: int = 2) -> Figure:
    """``Y = X A`` with ``A`` cut by rows and ``X`` by columns: ``Y = sum_i X_i A_i`` (``g``)."""
    if input_size % tp:
        raise ValueError(f"input_size {input_size} is not divisible by tp {tp}")
    colors = rank_colors(tp)
    fig = _figure(10.5, 3.9)
    ax = fig.add_subplot()
    in_w, in_h, out_w, b_h = 2.4, 2.4, 2.4, 1.0
    w = in_w / tp
    for r in range(tp):
        _block(ax, r * w, 1.4, w, b_h, colors[r], f"X{r}")
    ax.text(in_w / 2, 2.55, f"X [b, {input_size}], cut by columns", ha="center", fontsize=9)
    ax.text(2.8, 1.9, "x", fontsize=16, ha="center", va="center")
    h = in_h / tp
    for r in range(tp):
        _block(ax, 3.2, 0.2 + in_h - (r + 1) * h, out_w, h, colors[r], f"A{r}")
    ax.text(3.2 + out_w / 2, 2.75, f"A [{input_size}, {output_size}], cut by rows", ha="center",
            fontsize=9)
    ax.text(6.0, 1.9, "=", fontsize=16, ha="center", va="center")
    # Partial results: every rank holds a full-shape [b, out] partial sum.
    for r in range(tp):
        off = 0.12 * (tp - 1 - r)
        _block(ax, 6.4 + off, 1.4 - off, 1.6, b_h, colors[r], f"X{r} A{r}" if r == tp - 1 else "",
               alpha=0.9)
    ax.text(7.2, 2.55, f"{tp} partial sums [b, {output_size}]", ha="center", fontsize=9)
    ax.text(7.2, 1.15 - 0.12 * (tp - 1), "one X_i A_i per rank", ha="center", va="top", fontsize=8)
    _arrow(ax, (8.2, 1.9), (9.0, 1.9), "g: all-reduce")
    _block(ax, 9.1, 1.4, 1.3, b_h, "#d9d9d9", "Y")
    ax.text(9.75, 2.55, "Y + b", ha="center", fontsize=9)
    ax.text(0, -0.35, f"t = {tp}: rank i keeps A_i [{input_size // tp}, {output_size}] (stored as "
            f"weight [{output_size}, {input_size // tp}]) and X_i [b, {input_size // tp}]; "
            f"the bias is added once, after the all-reduce", fontsize=8, va="top")
    ax.set_xlim(-0.2, 10.6)
    ax.set_ylim(-0.8, 3.0)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("Row-parallel linear (Megatron-LM section 3): A = [A_0; ...; A_{t-1}], "
                 "X = [X_0, ..., X_{t-1}]", loc="left")
    fig.tight_layout()
    return fig


@_styled
def plot_fg(tp: int = 2) -> Figure:
    """The MLP of Megatron-LM Fig. 3a: ``f`` -> column-parallel ``A`` -> GeLU -> row-parallel
    ``B`` -> ``g``, one lane per tensor-parallel rank."""
    colors = rank_colors(tp)
    fig = _figure(10.5, 1.2 + 0.9 * tp)
    ax = fig.add_subplot()
    lane = 0.9
    top = lane * tp
    mid = top / 2

    def op(x, text, sub):
        ax.add_patch(FancyBboxPatch((x - 0.35, mid - 0.35), 0.7, 0.7,
                                    boxstyle="round,pad=0.02,rounding_size=0.1",
                                    facecolor="#fff2cc", edgecolor="#8a6d00", linewidth=1.2))
        ax.text(x, mid, text, ha="center", va="center", fontsize=14, fontweight="bold")
        ax.text(x, mid - 0.55, sub, ha="center", va="top", fontsize=7.5)

    _block(ax, 0.0, mid - 0.3, 0.8, 0.6, "#d9d9d9", "X")
    _arrow(ax, (0.8, mid), (1.4, mid))
    op(1.75, "f", "fwd: identity\nbwd: all-reduce")
    for r in range(tp):
        y = top - (r + 0.5) * lane
        _arrow(ax, (2.1, mid), (2.8, y), style="-|>")
        _block(ax, 2.8, y - 0.28, 1.6, 0.56, colors[r], f"X A{r}  (col.)", fontsize=8)
        _arrow(ax, (4.4, y), (4.8, y))
        _block(ax, 4.8, y - 0.28, 1.1, 0.56, colors[r], f"GeLU -> Y{r}", fontsize=8)
        _arrow(ax, (5.9, y), (6.3, y))
        _block(ax, 6.3, y - 0.28, 1.5, 0.56, colors[r], f"Y{r} B{r}  (row)", fontsize=8)
        _arrow(ax, (7.8, y), (8.4, mid))
    op(8.75, "g", "fwd: all-reduce\nbwd: identity")
    _arrow(ax, (9.1, mid), (9.6, mid))
    _block(ax, 9.6, mid - 0.3, 0.8, 0.6, "#d9d9d9", "Z")
    ax.set_xlim(-0.1, 10.5)
    ax.set_ylim(-0.2, top + 0.1)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"f and g around a tensor-parallel MLP, t = {tp} (one lane per rank)", loc="left")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- lab 04: collectives
def _as_2d(values) -> Optional[np.ndarray]:
    if values is None:          # this rank holds nothing (e.g. a broadcast receiver before)
        return None
    arr = np.asarray(values, dtype=float)
    if arr.ndim == 0:
        arr = arr.reshape(1, 1)
    elif arr.ndim == 1:
        arr = arr.reshape(1, -1)
    elif arr.ndim > 2:
        arr = arr.reshape(-1, arr.shape[-1])
    return arr


def _summary(arr: np.ndarray) -> str:
    """``2x4, all 3`` / ``1x16: 0 x8, 1 x8`` (runs, when few) / ``8x8``."""
    shape = f"{arr.shape[0]}x{arr.shape[1]}"
    flat = arr.ravel()
    if not flat.size:
        return shape
    runs = []
    for v in flat:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    if len(runs) == 1:
        return f"{shape}, all {runs[0][0]:g}"
    if len(runs) <= 4:
        return f"{shape}: " + ", ".join(f"{v:g} x{n}" for v, n in runs)
    return shape


@_styled
def plot_collective(title: str, before: Sequence, after: Sequence,
                    groups: Optional[Sequence[Sequence[int]]] = None,
                    labels: Sequence[str] = ("before", "after")) -> Figure:
    """Each rank's tensor before and after a collective, one column per rank.

    ``before``/``after``: per rank (rank order), nested lists or arrays (0-, 1- or 2-D; more
    dimensions are flattened to 2-D). Small tensors get their values written in; all panels
    share one colour scale. ``groups`` (e.g. the tensor-parallel groups) are marked above the
    columns so one sees which ranks talked to each other.
    """
    before = [_as_2d(b) for b in before]
    after = [_as_2d(a) for a in after]
    if len(before) != len(after):
        raise ValueError(f"{len(before)} 'before' tensors but {len(after)} 'after' tensors")
    n = len(before)
    present = [a.ravel() for a in before + after if a is not None]
    values = np.concatenate(present) if present else np.zeros(1)
    vmin, vmax = float(values.min()), float(values.max())
    if vmin == vmax:
        vmin, vmax = vmin - 1, vmax + 1
    fig = _figure(max(6.0, 1.25 * n + 1.0), 3.3)
    axes = fig.subplots(2, n, squeeze=False)
    group_of = {}
    if groups:
        for i, g in enumerate(groups):
            for r in g:
                group_of[r] = i
    gcolors = group_colors(len(groups)) if groups else []
    for row, (name, tensors) in enumerate(zip(labels, (before, after))):
        for r, arr in enumerate(tensors):
            ax = axes[row, r]
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_ylabel(name, fontsize=9)
            if row == 0:
                ax.set_title(f"rank {r}", fontsize=9,
                             color=gcolors[group_of[r]] if r in group_of else "black",
                             fontweight="bold" if r in group_of else "normal")
            if arr is None:
                ax.text(0.5, 0.5, "nothing", ha="center", va="center", fontsize=8,
                        color="#777777", transform=ax.transAxes)
                ax.set_xlabel("-", fontsize=7)
                continue
            ax.imshow(arr, cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto",
                      interpolation="nearest")
            if arr.size <= 16 and arr.shape[1] <= 8:
                for (i, j), v in np.ndenumerate(arr):
                    shade = (v - vmin) / (vmax - vmin)
                    ax.text(j, i, f"{v:g}", ha="center", va="center", fontsize=7,
                            color="white" if shade < 0.6 else "black")
            ax.set_xlabel(_summary(arr), fontsize=7)
    sub = ""
    if groups:
        sub = "  (groups: " + " ".join(str(list(g)) for g in groups) + ")"
    fig.suptitle(title + sub, x=0.01, ha="left", fontsize=10)
    fig.tight_layout()
    return fig


# Megatron's unit-test layouts, as launch/collectives.py runs them on 8 ranks: (tp, pp).
COLLECTIVE_LAYOUTS = {"broadcast": (2, 4), "copy": (4, 2), "reduce": (4, 2), "scatter": (4, 2),
                      "gather": (4, 2), "gather_split": (2, 4), "sequence": (4, 2)}


def _filled(values, n):
    return [float(v) for v in values for _ in range(n)]


def collective_views(name: str, results: Sequence[dict]) -> List[tuple]:
    """``(title, before, after, tp_groups)`` per picture of one test of ``launch/collectives.py``.

    ``results`` are the job's per-rank reports (``job.results``). The *after* side is what each
    rank reported; the *before* side is the input the test builds on each rank (a rank's own
    number, an ``arange``...), rebuilt here from the same rule.
    """
    tp, pp = COLLECTIVE_LAYOUTS[name]
    world = len(results)
    groups = parallel_state.generate_rank_groups(world, tp, pp)["tp"]
    group_of = {r: g for g in groups for r in g}
    got = [res["tests"][name] for res in results]
    ranks = range(world)
    if name == "broadcast":
        before = [[0.0, 1.0] if r == group_of[r][0] else None for r in ranks]
        after = [g["means"] for g in got]
        return [("broadcast_data([0, 1], ...): keys 0 and 1 (8x8 of 0s, of 1s; means shown) go "
                 "from each group's first rank to the others", before, after, groups)]
    if name in ("copy", "reduce"):
        what = ("copy_to_tensor_model_parallel_region, backward (f: all-reduce)" if name == "copy"
                else "reduce_from_tensor_model_parallel_region, forward (g: all-reduce)")
        return [(what, [[float(r)] for r in ranks], [[g["value"]] for g in got], groups)]
    if name == "scatter":
        full = np.arange(8 * tp, dtype=float).reshape(8, tp)
        before = [full for _ in ranks]
        after = [full[:, g["column"]:g["column"] + 1].T for g in got]
        return [("scatter_to_tensor_model_parallel_region: each rank keeps its column of the "
                 f"(8, {tp}) input (shown transposed)", before, after, groups)]
    if name == "gather":
        before = [[float(r)] * 8 for r in ranks]
        after = [_filled(g["blocks"], 8) for g in got]
        return [("gather_from_tensor_model_parallel_region: all-gather along the last dimension",
                 before, after, groups)]
    if name == "gather_split":
        before = [np.full((2, 4), float(r)) for r in ranks]
        after = [g["output"] for g in got]
        return [("gather_split_1d_tensor: the group's flattened (2, 4) tensors, concatenated",
                 before, after, groups)]
    if name == "sequence":
        seq = np.arange(2 * tp * 4, dtype=float).reshape(2 * tp, 4)
        scatter_after = [seq[g["rows"][0]:g["rows"][1]] for g in got]
        gather_after = [np.array(_filled(group_of[r], 4)).reshape(tp, 4) for r in ranks]
        rows = np.array([[float(i)] * 4 for i in range(tp)])
        rs_after = [[g["reduce_scatter"]] * 4 for g in got]
        return [
            (f"scatter_to_sequence_parallel_region: each rank keeps its block of the {2 * tp} "
             f"sequence rows (dim 0)", [seq for _ in ranks], scatter_after, groups),
            ("gather_from_sequence_parallel_region: all-gather along the sequence (dim 0)",
             [[float(r)] * 4 for r in ranks], gather_after, groups),
            (f"reduce_scatter_to_sequence_parallel_region: sum the ({tp}, 4) inputs, keep row "
             f"tp_rank", [rows for _ in ranks], rs_after, groups),
        ]
    raise ValueError(f"unknown test {name!r}; known: {sorted(COLLECTIVE_LAYOUTS)}")


def show_collective(name: str, results: Sequence[dict]) -> List[Figure]:
    """Display the before/after picture(s) of one collectives test; return the figures."""
    figs = [plot_collective(title, before, after, groups)
            for title, before, after, groups in collective_views(name, results)]
    for fig in figs:
        _display(fig)
    return figs


def print_log_section(lines: Sequence[str], start: str, end: str) -> None:
    """Print one section of a rank's log: from the first line starting with ``start`` through
    the next line starting with ``end`` (both included)."""
    inside, shown = False, 0
    for text in lines:
        inside = inside or text.startswith(start)
        if inside:
            print(text)
            shown += 1
            if shown > 1 and text.startswith(end):
                return
    if not shown:
        print(f"(no log section starting with {start!r})")


def print_test_log(lines: Sequence[str], name: str) -> None:
    """Print test ``name``'s part of a ``launch/collectives.py`` log (rank 0's lines, which
    hold every rank's line in rank order): from ``== name`` to ``name: passed ...``."""
    print_log_section(lines, f"== {name} ", f"{name}: ")


def print_parallel_linear(results: Sequence[dict], kind: str = "column") -> None:
    """One row per rank of a ``launch/parallel_linear.py`` job, floats reduced to verdicts."""
    print(f"{kind} parallel, tp={results[0]['tp']}")
    print("rank  tp_rank  A_i            weight         shard = slice of master  "
          "output == dense  grads within 1e-6")
    for res in results:
        r = res[kind]
        grads = max(r["output_error"], r["input_grad_error"], r["weight_grad_error"]) <= 1e-6
        exact = ("bit-exact" if r["output_bit_exact"] else
                 "within 1e-6" if r["output_error"] <= 1e-6 else "NO")
        print(f"{res['rank']:>4}  {r['tp_rank']:>7}  {str(r['A_shape']):<13}  "
              f"{str(r['weight_shape']):<13}  {str(r['shard_is_master_slice']):<23}  "
              f"{exact:<15}  {grads}")


# --------------------------------------------------------------------------- lab 05: the layer
def _op(ax, x, y, text, sub, width=0.8):
    ax.add_patch(FancyBboxPatch((x - width / 2, y - 0.32), width, 0.64,
                                boxstyle="round,pad=0.02,rounding_size=0.1",
                                facecolor="#fff2cc", edgecolor="#8a6d00", linewidth=1.2))
    ax.text(x, y, text, ha="center", va="center", fontsize=9 if len(text) > 2 else 13,
            fontweight="bold")
    ax.text(x, y - 0.42, sub, ha="center", va="top", fontsize=7)


def _layer_block(ax, tp: int, sequence_parallel: bool, block: str) -> None:
    """One row of :func:`plot_transformer_layer`: LN -> f -> t lanes of 3 ops -> g -> + x."""
    colors = rank_colors(tp)
    lane = 0.8
    top = lane * tp
    mid = top / 2
    rows = "s/t" if sequence_parallel else "s"
    if block == "attention":
        lanes = [("x W^QKV_{i}  (col.)", "[s, b, 3h/t]"), ("softmax(Q K^T / sqrt(H)) V", "n_H/t heads"),
                 ("Z_{i} W^O_{i}  (row)", "[s, b, h] partial")]
    else:
        lanes = [("x W^1_{i}  (col.)", "[s, b, 4h/t]"), ("GeLU", "elementwise"),
                 ("A'_{i} W^2_{i}  (row)", "[s, b, h] partial")]
    f_name, f_sub = (("AG", "all-gather along s\nbwd: reduce-scatter") if sequence_parallel
                     else ("f", "fwd: identity\nbwd: all-reduce"))
    g_name, g_sub = (("RS", "reduce-scatter along s\nbwd: all-gather") if sequence_parallel
                     else ("g", "fwd: all-reduce\nbwd: identity"))
    _block(ax, 0.0, mid - 0.3, 1.0, 0.6, "#d9d9d9", f"x\n[{rows}, b, h]", fontsize=8)
    _arrow(ax, (1.0, mid), (1.3, mid))
    _block(ax, 1.3, mid - 0.3, 0.9, 0.6, "#e8e8e8", f"LayerNorm\n[{rows}, b, h]", fontsize=7.5)
    _arrow(ax, (2.2, mid), (2.5, mid))
    _op(ax, 2.9, mid, f_name, f_sub)
    for r in range(tp):
        y = top - (r + 0.5) * lane
        _arrow(ax, (3.3, mid), (3.7, y))
        x = 3.7
        for k, (text, sub) in enumerate(lanes):
            label = text.replace("{i}", str(r))
            _block(ax, x, y - 0.27, 1.9, 0.54, colors[r], f"{label}\n{sub}", fontsize=7)
            if k < len(lanes) - 1:
                _arrow(ax, (x + 1.9, y), (x + 2.15, y))
            x += 2.15
        _arrow(ax, (x - 0.25, y), (10.35, mid))
    _op(ax, 10.75, mid, g_name, g_sub)
    _arrow(ax, (11.15, mid), (11.45, mid))
    _block(ax, 11.45, mid - 0.3, 1.0, 0.6, "#d9d9d9", f"+ x\n[{rows}, b, h]", fontsize=8)
    ax.set_xlim(-0.1, 12.55)
    ax.set_ylim(_layer_block_bottom(tp), top + 0.05)
    ax.set_aspect("equal")
    ax.axis("off")


def _layer_block_bottom(tp: int) -> float:
    """Lowest y of a :func:`_layer_block` drawing (the captions under f and g)."""
    return min(0.0, 0.4 * tp - 0.9) - 0.05


@_styled
def plot_transformer_layer(tp: int = 2, sequence_parallel: bool = False) -> Figure:
    """One GPT layer under tensor parallelism (Megatron-LM Fig. 3; Korthikanti et al. Fig. 5
    with ``sequence_parallel``): the attention block and the MLP block, one lane per
    tensor-parallel rank, with the two collectives of each block."""
    panel = 0.8 * tp + 0.05 - _layer_block_bottom(tp)       # drawing units; ~0.93 inch each
    fig = _figure(12.5, 2 * (0.93 * panel + 0.4))
    axes = fig.subplots(2, 1)
    for ax, block in zip(axes, ("attention", "mlp")):
        _layer_block(ax, tp, sequence_parallel, block)
    if sequence_parallel:
        titles = (f"Attention block, t = {tp}, sequence parallel: LayerNorm on the rank's s/t "
                  f"tokens; all-gather before the QKV projection, reduce-scatter after W^O",
                  "MLP block: all-gather before fc1, reduce-scatter after fc2 "
                  "(4 collectives forward, 4 backward per layer)")
    else:
        titles = (f"Attention block, t = {tp}: each rank computes n_H/t whole heads; f before "
                  f"the column-parallel QKV, g after the row-parallel W^O",
                  "MLP block: f before fc1 (column), g after fc2 (row): "
                  "2 all-reduces forward and 2 backward per layer")
    for ax, title in zip(axes, titles):
        ax.set_title(title, loc="left", fontsize=9.5)
    fig.tight_layout()
    return fig


_CATEGORY_COLORS = ("#c44e52", "#4c72b0", "#dd8452", "#8172b3", "#937860")


@_styled
def plot_activation_memory(rows: Sequence[dict], s: int, b: int, h: int) -> Figure:
    """Activation bytes per layer on one rank, in units of ``s b h``: for each configuration
    the paper's terms (16-bit, hatched) next to this package's (fp32, dropout 0), stacked by
    kind, and a black bar at the measured total (:mod:`mpu_lab.models.memory`)."""
    from mpu_lab.models import memory
    sbh = s * b * h
    fig = _figure(10.5, 4.2)
    ax = fig.add_subplot()
    width = 0.36
    labelled = set()
    for i, row in enumerate(rows):
        for j, (key, hatch) in enumerate((("paper_terms", "//"), ("model_terms", None))):
            x = i + (j - 0.5) * (width + 0.04)
            bottom = 0.0
            for c, color in zip(memory.CATEGORIES, _CATEGORY_COLORS):
                height = sum(v for _, cat, v in row[key] if cat == c) / sbh
                if height:
                    ax.bar(x, height, width, bottom=bottom, color=color, hatch=hatch,
                           edgecolor="white", linewidth=0.6,
                           label=c if c not in labelled else None)
                    labelled.add(c)
                bottom += height
            ax.text(x, bottom + 1, f"{bottom:.1f}", ha="center", va="bottom", fontsize=8)
        measured = row["measured"] / sbh
        x = i + 0.5 * (width + 0.04)
        ax.plot([x - width / 2, x + width / 2], [measured, measured], color="black", linewidth=2.5,
                label="measured (saved-tensor hooks)" if i == 0 else None)
    names = [memory.config_name(r) for r in rows]
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{n}\npaper 16-bit | mpu_lab fp32" for n in names])
    ax.set_ylabel("bytes per layer / (s b h)")
    ax.set_ylim(0, max(max(memory.total(r["model_terms"]), r["paper"]) for r in rows) / sbh * 1.15)
    ax.legend(fontsize=7.5, loc="upper right", frameon=False)
    ax.set_title(f"Activation memory of one layer on one rank (s={s}, b={b}, h={h}); hatched: "
                 f"Korthikanti et al. 2022, solid: this package", loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- lab 07: losses
_CURVE_STYLES = ({"linewidth": 4.0, "alpha": 0.45}, {"linewidth": 1.8, "linestyle": "--"},
                 {"linewidth": 1.4, "linestyle": ":"}, {"linewidth": 1.2, "linestyle": "-."})


@_styled
def plot_loss_curves(curves: Dict[str, tuple], title: str = "", reference: Optional[str] = None,
                     checkpoint_at: Optional[int] = None) -> Figure:
    """Loss against iteration for each ``label: (iterations, losses)``, drawn so that curves
    lying on top of each other stay visible (wide pale line first, then dashed and dotted).
    ``reference``: add a lower panel with each other curve's relative difference from it.
    ``checkpoint_at``: a vertical line at the iteration a checkpoint was saved and resumed."""
    fig = _figure(10.5, 5.2 if reference else 3.6)
    if reference:
        ax, diff = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2.2, 1]})
    else:
        ax, diff = fig.add_subplot(), None
    colors = group_colors(len(curves))
    for k, (label, (its, losses)) in enumerate(curves.items()):
        ax.plot(its, losses, color=colors[k], label=label, **_CURVE_STYLES[k % len(_CURVE_STYLES)])
    if checkpoint_at is not None:
        for a in (ax, diff) if diff is not None else (ax,):
            a.axvline(checkpoint_at, color="#555555", linewidth=1, linestyle="--")
        ax.text(checkpoint_at, ax.get_ylim()[1], f" checkpoint (iteration {checkpoint_at})",
                va="top", fontsize=8, color="#555555")
    ax.set_ylabel("lm loss")
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(title, loc="left")
    if diff is not None:
        ref_its, ref = curves[reference]
        ref_at = dict(zip(ref_its, ref))
        for k, (label, (its, losses)) in enumerate(curves.items()):
            if label == reference:
                continue
            rel = [max(abs(v - ref_at[i]) / abs(ref_at[i]), 1e-12) for i, v in zip(its, losses)
                   if i in ref_at]
            diff.plot([i for i in its if i in ref_at], rel, color=colors[k], marker=".",
                      linewidth=0.8, label=f"|{label} - {reference}| / {reference}")
        diff.axhline(1e-5, color="#c44e52", linewidth=1, linestyle="--", label="1e-5")
        diff.set_yscale("log")
        diff.set_ylim(1e-12, 1e-3)
        diff.set_ylabel("relative difference\n(0 drawn at 1e-12)")
        diff.legend(frameon=False, fontsize=7, ncol=3, loc="upper right")
    (diff if diff is not None else ax).set_xlabel("iteration")
    for a in (ax, diff) if diff is not None else (ax,):
        for side in ("top", "right"):
            a.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


class LiveLossPlot:
    """A loss curve redrawn in place while a job runs (in a notebook: one output that is
    updated through an IPython display handle; elsewhere nothing is shown).

    ``update(iterations, losses)`` redraws at most every ``every_s`` seconds (``force=True``:
    now); ``close()`` draws the final state."""

    def __init__(self, title: str, total_iterations: int, every_s: float = 0.5):
        import time
        self._time = time.monotonic
        self.every_s, self._last = every_s, -1e9
        with matplotlib.rc_context(STYLE):
            self.fig = _figure(8.0, 3.2)
            self.ax = self.fig.add_subplot()
            (self.line,) = self.ax.plot([], [], color=group_colors(1)[0], linewidth=1.6)
            self.ax.set_xlim(0, total_iterations)
            self.ax.set_xlabel("iteration")
            self.ax.set_ylabel("lm loss")
            self.ax.set_title(title, loc="left")
            self.fig.tight_layout()
        self.handle = None
        try:
            from IPython import get_ipython
            from IPython.display import display
            if get_ipython() is not None:
                self.handle = display(self.fig, display_id=True)
        except ImportError:
            pass

    def update(self, iterations: Sequence[int], losses: Sequence[float], force: bool = False):
        if not force and self._time() - self._last < self.every_s:
            return
        self._last = self._time()
        self.line.set_data(list(iterations), list(losses))
        if len(losses):
            low, high = min(losses), max(losses)
            pad = 0.05 * (high - low or 1.0)
            self.ax.set_ylim(low - pad, high + pad)
        if self.handle is not None:
            with matplotlib.rc_context(STYLE):
                self.handle.update(self.fig)


# --------------------------------------------------------------------------- figures/
def figure_catalog() -> Dict[str, Callable[[], Figure]]:
    """The figures committed under ``figures/``, by file name (built on demand)."""
    return {
        "rank_groups_tp2_pp4_16gpu.png": lambda: plot_group_families(16, 2, 4),
        "rank_groups_tp4_pp2_16gpu.png": lambda: plot_group_families(16, 4, 2),
        "rank_groups_tp_slowest_16gpu.png": lambda: plot_group_families(16, 2, 4, order="pp-dp-tp"),
        "column_split_tp2.png": lambda: plot_column_split(1024, 512, 2),
        "column_split_stride3_tp2.png": lambda: plot_column_split(1024, 768, 2, stride=3),
        "row_split_tp2.png": lambda: plot_row_split(1024, 512, 2),
        "fg_mlp_tp2.png": lambda: plot_fg(2),
        "transformer_layer_tp2.png": lambda: plot_transformer_layer(2),
        "transformer_layer_tp2_sp.png": lambda: plot_transformer_layer(2, sequence_parallel=True),
        "utilisation_pipeline_m1_vs_m8.png": _schedule_utilisation_figure,
    }


def _schedule_utilisation_figure() -> Figure:
    """Lab 08: what a perfect machine would show for a 4-stage 1F1B pipeline fed 1 or 8
    micro-batches per iteration (three iterations)."""
    from mpu_lab.perf.measure import schedule_utilisation
    return plot_utilisation({f"p = 4, m = {m}": schedule_utilisation("1f1b", 4, m) for m in (1, 8)},
                            "Busy (100 %) or waiting, per pipeline stage: 1F1B, three iterations",
                            xlabel="time (one forward pass = 1)")


def save_figure(fig: Figure, path) -> pathlib.Path:
    """Save ``fig`` as a byte-stable PNG (no software/date metadata, fixed dpi)."""
    path = pathlib.Path(path)
    with matplotlib.rc_context(STYLE):
        fig.savefig(path, dpi=STYLE["savefig.dpi"], metadata={"Software": None},
                    facecolor="white")
    return path


def save_figures(directory, names: Optional[Iterable[str]] = None) -> List[pathlib.Path]:
    """Write the catalogue's figures (or only ``names``) into ``directory``; return the paths."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    catalog = figure_catalog()
    wanted = list(names) if names is not None else list(catalog)
    unknown = [n for n in wanted if n not in catalog]
    if unknown:
        raise ValueError(f"unknown figure(s) {unknown}; known: {sorted(catalog)}")
    return [save_figure(catalog[name](), directory / name) for name in wanted]


# --------------------------------------------------------------------------- lab 08: performance
# One colour per step-time category (mpu_lab.perf.measure.CATEGORY_ORDER): computation green,
# tensor-parallel collectives blues, data-parallel orange, pipeline p2p red, the rest greys.
BREAKDOWN_COLORS = {
    "compute": "#55a868", "tp all_reduce": "#1f4e79", "tp all_gather": "#4c72b0",
    "tp reduce_scatter": "#7fa7d6", "tp broadcast": "#b3cde3", "dp all_reduce": "#dd8452",
    "pp p2p": "#c44e52", "other": "#999999", "wait (barrier)": "#dddddd",
}


@_styled
def plot_utilisation(runs: Dict[str, object], title: str = "", vmax: float = 100.0,
                     xlabel: str = "seconds") -> Figure:
    """Utilisation over time, one heat row per rank, one panel per run side by side
    (``label: mpu_lab.perf.measure.Utilisation``, e.g. cropped to the training window).
    Time is counted from each run's first sample; white where a rank had not started. Under
    CPU sampling a last row shows the whole machine (percent of all cores, every process)."""
    fig = _figure(5.4 * len(runs) + 0.8, 0.42 * max(len(u.values) + 1 for u in runs.values()) + 1.5)
    fig.set_layout_engine("constrained")
    axes = fig.subplots(1, len(runs), squeeze=False)[0]
    mesh = None
    for ax, (label, util) in zip(axes, runs.items()):
        ranks = sorted(util.values)
        if not util.times or not ranks:
            ax.set_title(f"{label}: no samples", loc="left")
            continue
        t = np.asarray(util.times) - util.times[0]
        half = np.diff(t).mean() / 2 if len(t) > 1 else util.interval_s / 2
        edges = np.concatenate([[t[0] - half], (t[:-1] + t[1:]) / 2, [t[-1] + half]])
        rows = [util.values[r] for r in ranks]
        means = util.mean()
        labels = [f"rank {r} ({means[r]:.0f}%)" for r in ranks]
        if util.kind in ("cpu", "runnable") and len(util.machine) == len(t):
            rows.append(util.machine)
            labels.append(f"machine ({np.mean(util.machine):.0f}% of {util.cores})")
        data = np.ma.masked_invalid(np.asarray(rows, dtype=float))
        mesh = ax.pcolormesh(edges, np.arange(len(rows) + 1), data, cmap="viridis", vmin=0,
                             vmax=vmax, shading="flat")
        ax.set_yticks(np.arange(len(rows)) + 0.5)
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        ax.set_title(label, loc="left")
    if mesh is not None:
        kind = next(iter(runs.values())).kind
        label = {"gpu": "GPU utilisation %", "cpu": "CPU %: ranks of one core",
                 "runnable": "running or runnable %"}.get(kind, "busy %")
        fig.colorbar(mesh, ax=list(axes), fraction=0.03, pad=0.01, label=label)
    if title:
        fig.suptitle(title, x=0.01, ha="left")
    return fig


@_styled
def plot_step_breakdown(runs: Dict[str, Sequence[dict]], title: str = "") -> Figure:
    """Where each rank's step time goes: one stacked bar per rank (milliseconds per step by
    category, from ``train_gpt.py --breakdown``), one panel per run (``label: reports``),
    sharing the time axis."""
    from mpu_lab.perf.measure import categories
    rows = sum(len(r) for r in runs.values())
    fig = _figure(9.5, 0.32 * rows + 1.0 * len(runs) + 0.8)
    fig.set_layout_engine("constrained")
    axes = fig.subplots(len(runs), 1, squeeze=False, sharex=True,
                        gridspec_kw={"height_ratios": [len(r) for r in runs.values()]})[:, 0]
    cats = categories([r for reports in runs.values() for r in reports])
    for ax, (label, reports) in zip(axes, runs.items()):
        left = np.zeros(len(reports))
        for cat in cats:
            ms = np.array([r["parts"].get(cat, 0.0) * 1e3 for r in reports])
            ax.barh(np.arange(len(reports)), ms, left=left, label=cat,
                    color=BREAKDOWN_COLORS.get(cat, "#cccccc"), edgecolor="white", linewidth=0.5)
            left += ms
        ax.set_yticks(np.arange(len(reports)))
        ax.set_yticklabels([f"rank {r['rank']} (tp {r['tp_rank']}, pp {r['pp_rank']}, "
                            f"dp {r['dp_rank']})" for r in reports], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(label, loc="left")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xlabel("milliseconds per step")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, frameon=False, fontsize=7, ncol=min(len(cats), 5),
               loc="outside lower left")
    if title:
        fig.suptitle(title, x=0.01, ha="left")
    return fig


@_styled
def plot_bandwidth(rows: Sequence[dict], title: str = "") -> Figure:
    """Bus bandwidth (GB/s) against message size, one line per collective
    (rows of ``launch/bench_bandwidth.py``)."""
    fig = _figure(7.0, 3.4)
    ax = fig.add_subplot()
    ops = list(dict.fromkeys(r["op"] for r in rows))
    for op, color in zip(ops, group_colors(len(ops))):
        mine = [r for r in rows if r["op"] == op]
        ax.plot([r["size_bytes"] for r in mine], [r["busbw"] / 1e9 for r in mine], marker="o",
                color=color, label=op)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(title, loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


@_styled
def plot_published_runs(rows: Sequence[dict], band: float = 0.15, title: str = "") -> Figure:
    """Published runs, predicted vs reported (rows of
    :func:`mpu_lab.perf.calibrate.published_runs_comparison`): left, both TFLOP/s per GPU per
    run; right, the relative error against a ``±band`` corridor. Calibration runs are hatched."""
    fig = _figure(10.5, 0.32 * len(rows) + 1.4)
    fig.set_layout_engine("constrained")
    left, right = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [1.6, 1]})
    y = np.arange(len(rows))
    colors = dict(zip(dict.fromkeys(r["gpu"] for r in rows), group_colors(4)))
    left.barh(y - 0.2, [r["reported_tflops"] for r in rows], height=0.4, color="#bbbbbb",
              label="reported")
    left.barh(y + 0.2, [r["predicted_tflops"] for r in rows], height=0.4,
              color=[colors[r["gpu"]] for r in rows], label="predicted",
              hatch=[("//" if r["calibration"] else "") for r in rows])
    left.set_yticks(y)
    left.set_yticklabels([r["name"] if f"{r['gpus']} " in r["name"]
                          else f"{r['name']} ({r['gpus']} {r['gpu'].upper()})" for r in rows],
                         fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("TFLOP/s per GPU")
    left.legend(frameon=False, fontsize=8, loc="lower right")
    right.axvspan(-100 * band, 100 * band, color="#dddddd", label=f"±{band:.0%}")
    right.axvline(0, color="#333333", linewidth=1)
    right.barh(y, [100 * r["error"] for r in rows], color=[colors[r["gpu"]] for r in rows],
               hatch=[("//" if r["calibration"] else "") for r in rows])
    right.set_xlabel("predicted / reported - 1 (%)")
    right.legend(frameon=False, fontsize=8, loc="lower right")
    for ax in (left, right):
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    if title:
        fig.suptitle(title, x=0.01, ha="left")
    return fig


_CAUSE_COLORS = {"compute": "#55a868", "tp_comm": "#1f4e79", "pp_p2p": "#c44e52",
                 "bubble": "#f2b5b5", "dp_comm": "#dd8452", "optimizer": "#999999"}


@_styled
def plot_exploration(result, title: str = "") -> Figure:
    """The explorer's verdict per (t, p) (:func:`mpu_lab.perf.explore`): for each pair its
    fastest micro-batch size, the predicted seconds per iteration split by cause, fastest on
    top; configurations that do not fit in memory are hatched and labelled OOM, the others
    carry the explorer's flags."""
    best = {}
    for c in result.candidates:                  # already ranked: the first of a pair is its best
        best.setdefault((c.config.tp, c.config.pp), c)
    picks = sorted(best.values(), key=lambda c: (not c.fits, c.prediction.total_s))
    fig = _figure(10.0, 0.28 * len(picks) + 1.3)
    fig.set_layout_engine("constrained")
    ax = fig.add_subplot()
    y = np.arange(len(picks))
    left = np.zeros(len(picks))
    for cause, color in _CAUSE_COLORS.items():
        secs = np.array([c.prediction.breakdown()[cause] for c in picks])
        ax.barh(y, secs, left=left, color=color, label=cause.replace("_", " "),
                hatch=[("" if c.fits else "//") for c in picks], edgecolor="white", linewidth=0.3)
        left += secs
    for i, c in enumerate(picks):
        note = c.short_flags() or "ok"
        ax.text(left[i], i, f" {note}", va="center", fontsize=7)
    ax.set_yticks(y)
    ax.set_yticklabels([f"t={c.config.tp} p={c.config.pp} d={c.config.dp} b={c.config.b}"
                        for c in picks], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, left.max() * 1.25)
    ax.set_xlabel("predicted seconds per iteration")
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles, names, frameon=False, fontsize=7, ncol=6, loc="outside lower left")
    ax.set_title(title, loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig
