"""Labs 06 and 07: a weight cut by columns or by rows across the tensor-parallel ranks.

The shard arithmetic (:func:`shard_shapes`, :func:`print_shard_shapes`, :func:`strided_owners`,
and for fused weights :func:`fused_row_labels` and :func:`print_rows_kept`) and its pictures:
:func:`plot_column_split`, :func:`plot_row_split`, and :func:`plot_fg`, the tensor-parallel MLP
with ``f`` and ``g`` (Megatron-LM §3, Fig. 3).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from mpu_lab.labkit.style import draw_arrow, draw_block, new_figure, rank_colors, styled


def shard_shapes(kind: str, input_size: int, output_size: int, parts: int) -> List[tuple]:
    """Shapes of ``A``'s pieces (``A`` is ``[input_size, output_size]``, ``Y = X A``).

    ``kind="column"`` cuts the columns (``A_i: [in, out/parts]``), ``"row"`` the rows
    (``A_i: [in/parts, out]``). The pieces are real ``torch.split`` views of a full matrix,
    the way Megatron slices its master weight; ``parts`` must divide the cut dimension.
    """
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
    pieces = [f"A{i}= torch.Size({list(s)})" for i, s in enumerate(shapes)]
    for k in range(0, len(pieces), 3):                  # three a line: lines of <= 100 characters
        print(", ".join(pieces[k:k + 3]) + ("," if k + 3 < len(pieces) else ""))
    print(" ]")
    print(f"{len(shapes)} pieces")


def strided_owners(size: int, tp: int, stride: int) -> List[int]:
    """Which tensor-parallel rank owns each row of a fused ``[size, ...]`` weight with ``stride``.

    Megatron cuts the master weight into ``tp * stride`` pieces of ``size / (tp * stride)``
    rows and gives rank ``r`` pieces ``r, r + tp, r + 2 tp, ...``: with a weight stored part
    after part (``[W_gate; W_up]`` with ``stride=2``, the legacy ``[W_Q; W_K; W_V]`` with
    ``stride=3``) every rank gets its slice of each part.
    """
    if tp < 1 or stride < 1:
        raise ValueError(f"tp and stride must be at least 1, got tp={tp}, stride={stride}")
    if size % (tp * stride):
        raise ValueError(f"{size} rows cannot be cut into tp*stride = {tp}*{stride} equal pieces")
    piece = size // (tp * stride)
    return [(row // piece) % tp for row in range(size)]


# Layouts of a small fused weight, by name: the order of its blocks of rows. "q1" is the block
# of W_Q that belongs to head 1, "g1" the second block of columns of the gate projection.
FUSED_LAYOUTS = {
    "qkv by head": "Megatron-core's linear_qkv: [q0; k0; v0; q1; k1; v1; ...], head by head",
    "qkv blocks": "the legacy layout: [W_Q; W_K; W_V] = [q0; q1; ...; k0; k1; ...; v0; v1; ...]",
    "gate-up blocks": "a SwiGLU linear_fc1 stored [W_gate; W_up] = [g0; g1; ...; u0; u1; ...]",
}


def fused_row_labels(layout: str, blocks: int = 2, rows: int = 2) -> List[str]:
    """One label per row of a small fused weight in ``layout`` (see :data:`FUSED_LAYOUTS`):
    ``blocks`` heads (or blocks of the feed-forward width) of ``rows`` rows each.

    >>> fused_row_labels("qkv by head", blocks=2, rows=1)
    ['q0', 'k0', 'v0', 'q1', 'k1', 'v1']
    >>> fused_row_labels("qkv blocks", blocks=2, rows=1)
    ['q0', 'q1', 'k0', 'k1', 'v0', 'v1']
    """
    if layout not in FUSED_LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(FUSED_LAYOUTS)}, got {layout!r}")
    if blocks < 1 or rows < 1:
        raise ValueError(f"blocks and rows must be at least 1, got blocks={blocks}, rows={rows}")
    if layout == "qkv by head":
        names = [f"{part}{j}" for j in range(blocks) for part in "qkv"]
    else:
        parts = "qkv" if layout == "qkv blocks" else "gu"
        names = [f"{part}{j}" for part in parts for j in range(blocks)]
    return [name for name in names for _ in range(rows)]


def print_rows_kept(labels: Sequence[str], tp: int, stride: int = 1) -> None:
    """Print, rank by rank, the labels of the rows each tensor-parallel rank keeps when the
    fused weight whose rows carry ``labels`` is split with ``stride`` (Megatron's split)."""
    owners = strided_owners(len(labels), tp, stride)
    for rank in range(tp):
        kept = [label for label, owner in zip(labels, owners) if owner == rank]
        print(f"rank {rank} keeps: {' '.join(kept)}")


def _default_part_names(stride: int) -> Optional[List[str]]:
    """The fused parts a ``stride`` usually means: 2, ``[W_gate; W_up]``; 3, ``[W_Q; W_K; W_V]``."""
    return {1: None, 2: ["gate", "up"], 3: ["Q", "K", "V"]}.get(
        stride, [f"P{i}" for i in range(stride)])


def _bracket(ax, x0: float, x1: float, y: float, text: str) -> None:
    """A bracket over ``[x0, x1]`` at height ``y`` with ``text`` above it."""
    ax.plot([x0 + 0.03, x0 + 0.03, x1 - 0.03, x1 - 0.03], [y, y + 0.1, y + 0.1, y],
            color="#222222", linewidth=1.0)
    ax.text((x0 + x1) / 2, y + 0.14, text, ha="center", va="bottom", fontsize=8.5)


@styled
def plot_column_split(input_size: int = 1024, output_size: int = 512, tp: int = 2,
                      stride: int = 1, part_names: Optional[Sequence[str]] = None) -> Figure:
    """``Y = X A`` with ``A`` cut by columns: rank ``i`` holds ``A_i`` and computes ``Y_i``.

    With ``stride > 1`` (a fused weight stored part after part, such as a SwiGLU
    ``[W_gate; W_up]`` or the legacy ``[W_Q; W_K; W_V]``) the columns are cut into
    ``tp * stride`` pieces dealt out round-robin, so each rank owns one piece of every part;
    brackets over ``A`` and ``Y`` name the parts (``part_names``, by default gate/up for
    ``stride=2`` and Q/K/V for ``stride=3``).
    """
    owners = strided_owners(output_size, tp, stride)
    names = list(part_names) if part_names is not None else _default_part_names(stride)
    if names is not None and (stride < 2 or len(names) != stride):
        raise ValueError(f"part_names names the {stride} fused parts of a stride-{stride} "
                         f"weight, got {len(names)} names: {names}")
    colors = rank_colors(tp)
    pieces = tp * stride
    fig = new_figure(10.5, 3.7 if names is None else 4.1)
    ax = fig.add_subplot()
    # Geometry (drawing units): X is [b, in], A is [in, out], Y is [b, out].
    in_h, out_w, b_h = 2.4, 3.0, 1.0
    x0, a0, y0 = 0.0, 3.2, 7.4
    draw_block(ax, x0, 1.4, 2.4, b_h, "#d9d9d9", f"X\n[b, {input_size}]\nsame on every rank")
    ax.text(2.8, 1.9, "x", fontsize=16, ha="center", va="center")
    w = out_w / pieces
    for p in range(pieces):
        rank = owners[p * (output_size // pieces)]
        label = f"A{rank}" if stride == 1 else f"r{rank}"
        draw_block(ax, a0 + p * w, 0.2, w, in_h, colors[rank], label if pieces <= 16 else "",
                   fontsize=9 if pieces <= 8 else 6.5)
    top = 2.75
    if names is not None:
        part_w = out_w / stride
        for i, name in enumerate(names):
            _bracket(ax, a0 + i * part_w, a0 + (i + 1) * part_w, 2.68,
                     rf"$W_{{\mathrm{{{name}}}}}^\top$")
            _bracket(ax, y0 + i * part_w, y0 + (i + 1) * part_w, 2.48, name)
        top = 3.3
    ax.text(a0 + out_w / 2, top, f"A [{input_size}, {output_size}], cut by columns", ha="center",
            fontsize=9)
    ax.text(6.8, 1.9, "=", fontsize=16, ha="center", va="center")
    for p in range(pieces):
        rank = owners[p * (output_size // pieces)]
        label = f"Y{rank}" if stride == 1 else f"r{rank}"
        draw_block(ax, y0 + p * w, 1.4, w, b_h, colors[rank], label if pieces <= 16 else "",
                   fontsize=9 if pieces <= 8 else 6.5)
    ax.text(y0 + out_w / 2, 2.55 if names is None else top, f"Y [b, {output_size}]", ha="center",
            fontsize=9)
    shard = f"[{input_size}, {output_size // tp}]"
    note = (f"t = {tp}: rank i keeps A_i {shard} (stored as weight [{output_size // tp}, "
            f"{input_size}]) and computes Y_i = X A_i [b, {output_size // tp}]; "
            f"gather_output=True all-gathers Y = [Y_0 ... Y_{tp - 1}]")
    if stride > 1:
        note = (f"stride = {stride}: {pieces} pieces of {output_size // pieces} columns dealt out "
                f"round-robin; rank r keeps pieces r, r+{tp}, ... (its slice of each fused part)")
    ax.text(0, -0.35, note, fontsize=8, va="top")
    ax.set_xlim(-0.2, 10.6)
    ax.set_ylim(-0.8, 3.0 if names is None else 3.55)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("Column-parallel linear (Megatron-LM section 3): A = [A_0, ..., A_{t-1}]",
                 loc="left")
    fig.tight_layout()
    return fig


@styled
def plot_row_split(input_size: int = 1024, output_size: int = 512, tp: int = 2) -> Figure:
    """``Y = X A`` with ``A`` cut by rows and ``X`` by columns: ``Y = sum_i X_i A_i`` (``g``)."""
    if input_size % tp:
        raise ValueError(f"input_size {input_size} is not divisible by tp {tp}")
    colors = rank_colors(tp)
    fig = new_figure(10.5, 3.9)
    ax = fig.add_subplot()
    in_w, in_h, out_w, b_h = 2.4, 2.4, 2.4, 1.0
    w = in_w / tp
    for r in range(tp):
        draw_block(ax, r * w, 1.4, w, b_h, colors[r], f"X{r}")
    ax.text(in_w / 2, 2.55, f"X [b, {input_size}], cut by columns", ha="center", fontsize=9)
    ax.text(2.8, 1.9, "x", fontsize=16, ha="center", va="center")
    h = in_h / tp
    for r in range(tp):
        draw_block(ax, 3.2, 0.2 + in_h - (r + 1) * h, out_w, h, colors[r], f"A{r}")
    ax.text(3.2 + out_w / 2, 2.75, f"A [{input_size}, {output_size}], cut by rows", ha="center",
            fontsize=9)
    ax.text(6.0, 1.9, "=", fontsize=16, ha="center", va="center")
    # Partial results: every rank holds a full-shape [b, out] partial sum.
    for r in range(tp):
        off = 0.12 * (tp - 1 - r)
        draw_block(ax, 6.4 + off, 1.4 - off, 1.6, b_h, colors[r],
                   f"X{r} A{r}" if r == tp - 1 else "", alpha=0.9)
    ax.text(7.2, 2.55, f"{tp} partial sums [b, {output_size}]", ha="center", fontsize=9)
    ax.text(7.2, 1.15 - 0.12 * (tp - 1), "one X_i A_i per rank", ha="center", va="top", fontsize=8)
    draw_arrow(ax, (8.2, 1.9), (9.0, 1.9), "g: all-reduce")
    draw_block(ax, 9.1, 1.4, 1.3, b_h, "#d9d9d9", "Y")
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


@styled
def plot_fg(tp: int = 2) -> Figure:
    """The MLP of Megatron-LM Fig. 3a: ``f`` -> column-parallel ``A`` -> GeLU -> row-parallel
    ``B`` -> ``g``, one lane per tensor-parallel rank."""
    colors = rank_colors(tp)
    fig = new_figure(10.5, 1.2 + 0.9 * tp)
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

    draw_block(ax, 0.0, mid - 0.3, 0.8, 0.6, "#d9d9d9", "X")
    draw_arrow(ax, (0.8, mid), (1.4, mid))
    op(1.75, "f", "fwd: identity\nbwd: all-reduce")
    for r in range(tp):
        y = top - (r + 0.5) * lane
        draw_arrow(ax, (2.1, mid), (2.8, y), style="-|>")
        draw_block(ax, 2.8, y - 0.28, 1.6, 0.56, colors[r], f"X A{r}  (col.)", fontsize=8)
        draw_arrow(ax, (4.4, y), (4.8, y))
        draw_block(ax, 4.8, y - 0.28, 1.1, 0.56, colors[r], f"GeLU -> Y{r}", fontsize=8)
        draw_arrow(ax, (5.9, y), (6.3, y))
        draw_block(ax, 6.3, y - 0.28, 1.5, 0.56, colors[r], f"Y{r} B{r}  (row)", fontsize=8)
        draw_arrow(ax, (7.8, y), (8.4, mid))
    op(8.75, "g", "fwd: all-reduce\nbwd: identity")
    draw_arrow(ax, (9.1, mid), (9.6, mid))
    draw_block(ax, 9.6, mid - 0.3, 0.8, 0.6, "#d9d9d9", "Z")
    ax.set_xlim(-0.1, 10.5)
    ax.set_ylim(-0.2, top + 0.1)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"f and g around a tensor-parallel MLP, t = {tp} (one lane per rank)", loc="left")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- the options' job
def format_calls(counts: dict) -> str:
    """One pass's collectives as ``1 all_reduce, 1 all_gather`` (``none`` when it has none)."""
    return ", ".join(f"{n} {kind}" for kind, n in counts.items()) or "none"


def format_options(results: Sequence[dict], name_width: int = 24) -> str:
    """``launch/linear_options.py``'s per-rank reports (``job.results``, rank order) as one
    table: a row per option with what every rank agrees on (the output's shape, the
    collectives of each pass, whether every rank matched its dense twin), then a line per rank
    for what differs between ranks (the master rows a fused layer keeps). An option named in
    more than ``name_width`` characters is shown by its layer and spelled out below."""
    per_case = list(zip(*(res["cases"] for res in results)))
    header = ("option", "output", "forward", "backward", "= dense")
    rows, notes = [], []
    for cases in per_case:
        first = cases[0]
        output = str(first["output_shape"])
        if "returned_bias_shape" in first:
            output += f", bias {first['returned_bias_shape']}"
        if "input_shape" in first:
            output += f", input {first['input_shape']}"
        agree = all((c["output_shape"], c["forward"], c["backward"]) ==
                    (first["output_shape"], first["forward"], first["backward"]) for c in cases)
        name = first["name"]
        if len(name) > name_width:
            notes.append(f"{first['layer']}: {name}")
            name = first["layer"]
        rows.append((name, output if agree else "differs by rank", format_calls(first["forward"]),
                     format_calls(first["backward"]), str(all(c["matches_dense"] for c in cases))))
        if "row_blocks" in first:
            notes += [f"{first['name']}, master rows kept on rank {res['rank']}: "
                      + " ".join(f"{a}-{b}" for a, b in c["row_blocks"])
                      for res, c in zip(results, cases)]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    layers = ", ".join(dict.fromkeys(c["layer"] for c in results[0]["cases"]))
    lines = [f"{layers}, tp={results[0]['tp']}: one row per option, the same on all "
             f"{len(results)} ranks", "(= dense: every rank matched its dense twin)"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header] + rows]
    return "\n".join(lines + notes)
