"""Lab 09's pictures: one transformer layer under tensor parallelism, its activation
memory, and the backward pass of Megatron's linear on a timeline (the gradient GEMMs on one
lane, the collectives from issued to known finished on another, overlapped and serial side
by side; ``launch/linear_overlap.py`` measures them, :mod:`mpu_lab.perf.linear_overlap`)."""
from __future__ import annotations

from typing import Sequence
from typing import Dict

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from mpu_lab.labkit.style import draw_arrow, draw_block, new_figure, rank_colors, styled
from mpu_lab.perf.saved_activations import config_name
from mpu_lab.perf.cost_model.activations import CATEGORIES, total


def _op(ax, x, y, text, sub, width=0.8):
    ax.add_patch(FancyBboxPatch((x - width / 2, y - 0.32), width, 0.64,
                                boxstyle="round,pad=0.02,rounding_size=0.1",
                                facecolor="#fff2cc", edgecolor="#8a6d00", linewidth=1.2))
    ax.text(x, y, text, ha="center", va="center", fontsize=9 if len(text) > 2 else 13,
            fontweight="bold")
    ax.text(x, y - 0.42, sub, ha="center", va="top", fontsize=7)


def _layer_block(ax, tp: int, sequence_parallel: bool, block: str,
                 activation: str = "relu") -> None:
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
        lanes = [("x W^1_{i}  (col.)", "[s, b, 4h/t]"), (activation, "elementwise"),
                 ("A'_{i} W^2_{i}  (row)", "[s, b, h] partial")]
    f_name, f_sub = (("AG", "all-gather along s\nbwd: AG again + RS") if sequence_parallel
                     else ("f", "fwd: identity\nbwd: all-reduce"))
    g_name, g_sub = (("RS", "reduce-scatter along s\nbwd: all-gather") if sequence_parallel
                     else ("g", "fwd: all-reduce\nbwd: identity"))
    draw_block(ax, 0.0, mid - 0.3, 1.0, 0.6, "#d9d9d9", f"x\n[{rows}, b, h]", fontsize=8)
    draw_arrow(ax, (1.0, mid), (1.3, mid))
    draw_block(ax, 1.3, mid - 0.3, 0.9, 0.6, "#e8e8e8", f"LayerNorm\n[{rows}, b, h]", fontsize=7.5)
    draw_arrow(ax, (2.2, mid), (2.5, mid))
    _op(ax, 2.9, mid, f_name, f_sub)
    for r in range(tp):
        y = top - (r + 0.5) * lane
        draw_arrow(ax, (3.3, mid), (3.7, y))
        x = 3.7
        for k, (text, sub) in enumerate(lanes):
            label = text.replace("{i}", str(r))
            draw_block(ax, x, y - 0.27, 1.9, 0.54, colors[r], f"{label}\n{sub}", fontsize=7)
            if k < len(lanes) - 1:
                draw_arrow(ax, (x + 1.9, y), (x + 2.15, y))
            x += 2.15
        draw_arrow(ax, (x - 0.25, y), (10.35, mid))
    _op(ax, 10.75, mid, g_name, g_sub)
    draw_arrow(ax, (11.15, mid), (11.45, mid))
    draw_block(ax, 11.45, mid - 0.3, 1.0, 0.6, "#d9d9d9", f"+ x\n[{rows}, b, h]", fontsize=8)
    ax.set_xlim(-0.1, 12.55)
    ax.set_ylim(_layer_block_bottom(tp), top + 0.05)
    ax.set_aspect("equal")
    ax.axis("off")


def _layer_block_bottom(tp: int) -> float:
    """Lowest y of a :func:`_layer_block` drawing (the captions under f and g)."""
    return min(0.0, 0.4 * tp - 0.9) - 0.05


@styled
def plot_transformer_layer(tp: int = 2, sequence_parallel: bool = False,
                           activation: str = "relu") -> Figure:
    """One GPT layer under tensor parallelism (Megatron-LM Fig. 3; Korthikanti et al. Fig. 5
    with ``sequence_parallel``): the attention block and the MLP block, one lane per
    tensor-parallel rank, with the two collectives of each block (under sequence parallelism the
    all-gather's backward also gathers the layer's input again, §4.2.2). ``activation``: the
    MLP's nonlinearity as the lab runs it (``--activation``; the lab's layer uses relu)."""
    panel = 0.8 * tp + 0.05 - _layer_block_bottom(tp)       # drawing units; ~0.93 inch each
    fig = new_figure(12.5, 2 * (0.93 * panel + 0.4))
    axes = fig.subplots(2, 1)
    for ax, block in zip(axes, ("attention", "mlp")):
        _layer_block(ax, tp, sequence_parallel, block, activation)
    if sequence_parallel:
        titles = (f"Attention block, t = {tp}, sequence parallel: LayerNorm on the rank's s/t "
                  f"tokens; all-gather before the QKV projection, reduce-scatter after W^O",
                  "MLP block: all-gather before fc1, reduce-scatter after fc2 (per layer: 4 "
                  "collectives forward, 6 backward with the inputs' re-gathers)")
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


@styled
def plot_activation_memory(rows: Sequence[dict], s: int, b: int, h: int) -> Figure:
    """Activation bytes per layer on one rank, in units of ``s b h``: for each configuration
    the paper's terms (16-bit, hatched) next to this package's (fp32, dropout 0), stacked by
    kind, and a black bar at the measured total (:mod:`mpu_lab.perf.saved_activations`)."""
    sbh = s * b * h
    fig = new_figure(10.5, 4.2)
    ax = fig.add_subplot()
    width = 0.36
    labelled = set()
    for i, row in enumerate(rows):
        for j, (key, hatch) in enumerate((("paper_terms", "//"), ("model_terms", None))):
            x = i + (j - 0.5) * (width + 0.04)
            bottom = 0.0
            for c, color in zip(CATEGORIES, _CATEGORY_COLORS):
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
    names = [config_name(r) for r in rows]
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{n}\npaper 16-bit | mpu_lab fp32" for n in names])
    ax.set_ylabel("bytes per layer / (s b h)")
    ax.set_ylim(0, max(max(total(r["model_terms"]), r["paper"]) for r in rows) / sbh * 1.15)
    ax.legend(fontsize=7.5, loc="upper right", frameon=False)
    ax.set_title(f"Activation memory of one layer on one rank (s={s}, b={b}, h={h}); hatched: "
                 f"Korthikanti et al. 2022, solid: this package", loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig

_GEMM, _COMM = "#4c72b0", "#dd8452"


@styled
def plot_backward_timeline(report: Dict, title: str = "") -> Figure:
    """One rank's report of ``launch/linear_overlap.py``: a row per mode ("overlap", "serial"),
    each with a GEMM lane and a communication lane; the backward time written at the end."""
    modes = report["modes"]
    fig = new_figure(8.0, 1.0 + 1.6 * len(modes))
    axes = fig.subplots(len(modes), 1, sharex=True, squeeze=False)[:, 0]
    end = max(v["backward_ms"] for v in modes.values())
    for ax, (mode, v) in zip(axes, modes.items()):
        for i, (what, start, stop) in enumerate(v["events"]):
            lane = 1 if what.startswith(("dX", "dW")) else 0
            ax.barh(lane, stop - start, left=start, height=0.6,
                    color=_GEMM if lane else _COMM, edgecolor="black", linewidth=0.5)
            # A label fits inside a box only when the box is wide enough; the others go outside
            # the lanes (GEMMs above, collectives below), at alternating heights, so that
            # neighbours do not overprint.
            if stop - start >= 0.12 * end:
                ax.text(start + (stop - start) / 2, lane, what, ha="center", va="center",
                        fontsize=7, clip_on=True)
            else:
                above, gap = lane == 1, 4 + 9 * (i % 2)
                ax.annotate(what, (start + (stop - start) / 2, lane + (0.3 if above else -0.3)),
                            xytext=(0, gap if above else -gap), textcoords="offset points",
                            ha="center", va="bottom" if above else "top", fontsize=6.5)
        ax.set_yticks([0, 1], ["collectives\n(issued to done)", "GEMMs"])
        ax.set_ylim(-1.2, 2.2)
        step = f", step {v['step_ms']:.1f} ms" if "step_ms" in v else ""
        ax.set_title(f"{mode}: backward {v['backward_ms']:.{3 if end < 10 else 1}f} ms{step}",
                     fontsize=9, loc="left")
        ax.axvline(v["backward_ms"], color="black", linewidth=0.8, linestyle=":")
    axes[-1].set_xlim(0, 1.05 * end)
    axes[-1].set_xlabel(f"ms from the start of one backward pass (rank {report['rank']}, "
                        f"t = {report['t']}, {report['device']})")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
