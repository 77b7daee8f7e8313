"""Lab 13: the roofline of one GPU's links, with each parallel dimension placed on it.

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

from mpu_lab.labkit.viz.style import group_colors, new_figure, styled
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
