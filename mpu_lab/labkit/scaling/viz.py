"""Lab 16's pictures: the roofline of one GPU's links, with each parallel dimension placed on
it; the cost model against published runs (:func:`plot_published_runs`) and the explorer's
verdict per ``(t, p)`` (:func:`plot_exploration`).

:func:`plot_roofline` draws attainable FLOP/s against arithmetic intensity (FLOPs per byte,
log-log) for each bandwidth of a cluster (HBM, NVLink, InfiniBand): a slope ``intensity x
bandwidth`` up to the flat peak, bending at the ridge ``peak / bandwidth``; then one marker
per :class:`~mpu_lab.perf.back_of_envelope.Traffic` at its intensity. A marker left of a
link's ridge is communication-bound on that link.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from mpu_lab.labkit.style import group_colors, new_figure, styled
from mpu_lab.perf.back_of_envelope import Traffic, links_of, ridge, roofline
from mpu_lab.perf.cost_model import DGX_H100, Cluster


@styled
def plot_roofline(cases: Sequence[Traffic], cluster: Cluster = DGX_H100,
                  title: str = "") -> Figure:
    """Rooflines of ``cluster``'s HBM, NVLink and network, and ``cases`` at their intensity
    (labelled by dimension and setting)."""
    links = dict(HBM=cluster.hbm_bandwidth, **links_of(cluster))
    peak = cluster.peak_flops
    finite = [c.intensity for c in cases if np.isfinite(c.intensity)]
    low = min([1.0] + [0.5 * x for x in finite])
    high = max([4 * ridge(peak, min(links.values()))] + [2 * x for x in finite])
    x = np.logspace(np.log10(low), np.log10(high), 200)
    fig = new_figure(8.5, 4.8)
    ax = fig.subplots()
    colors = group_colors(len(links))
    for (name, bw), color in zip(links.items(), colors):
        ax.plot(x, [roofline(i, peak, bw) / 1e12 for i in x], color=color,
                label=f"{name} {bw / 1e9:,.0f} GB/s: ridge {ridge(peak, bw):,.0f} FLOP/B")
        ax.axvline(ridge(peak, bw), color=color, linestyle=":", linewidth=1)
    for case in cases:
        if not np.isfinite(case.intensity):
            continue
        ax.plot([case.intensity], [peak / 1e12], marker="v", color="#333333")
        ax.annotate(f"{case.strategy} {case.setting.split(',')[0]}",
                    (case.intensity, peak / 1e12), xytext=(0, -8), textcoords="offset points",
                    fontsize=8, rotation=90, ha="center", va="top")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity: FLOPs per byte moved")
    ax.set_ylabel("attainable TFLOP/s per GPU")
    ax.set_title(title or f"{cluster.name}: roofline per link, the dimensions at their "
                          f"intensity (markers)")
    ax.legend(loc="lower right", fontsize="small")
    return fig


@styled
def plot_published_runs(rows: Sequence[dict], band: float = 0.15, title: str = "") -> Figure:
    """Published runs, predicted vs reported (rows of
    :func:`mpu_lab.perf.published_runs.published_runs_comparison`): left, both TFLOP/s per GPU per
    run, each in its source's FLOP count (:data:`mpu_lab.perf.published_runs.FLOP_CONVENTIONS`);
    right, the relative error against a ``±band`` corridor. Calibration runs are hatched."""
    fig = new_figure(10.5, 0.32 * len(rows) + 1.4)
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
    left.set_xlabel("TFLOP/s per GPU, in each source's count (96 or 72 form)")
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


@styled
def plot_exploration(result, title: str = "") -> Figure:
    """The explorer's verdict per (t, p) (:func:`mpu_lab.perf.explore`): for each pair its
    fastest micro-batch size, the predicted seconds per iteration split by cause, fastest on
    top; configurations that do not fit in memory are hatched and labelled OOM, the others
    carry the explorer's flags."""
    best = {}
    for c in result.candidates:                  # already ranked: the first of a pair is its best
        best.setdefault((c.config.tp, c.config.pp), c)
    picks = sorted(best.values(), key=lambda c: (not c.fits, c.prediction.total_s))
    fig = new_figure(10.0, 0.28 * len(picks) + 1.3)
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
