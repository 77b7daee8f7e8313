"""Lab 15: where the time goes — utilisation, step-time breakdowns, bandwidth, the cost model.

:func:`plot_utilisation` (one heat row per rank), :func:`plot_kernel_timeline` (compute /
communication / idle per rank from the profiler's traces), :func:`plot_step_breakdown` (stacked
milliseconds per step by category) and :func:`plot_bandwidth` (bus bandwidth against message
size, lab 02's too). Lab 16's pictures of the cost model are in
:mod:`mpu_lab.labkit.scaling.viz`.
"""
from __future__ import annotations

from typing import Dict, Sequence

import numpy as np
from matplotlib.figure import Figure

from mpu_lab.labkit.style import group_colors, new_figure, styled
from mpu_lab.perf.breakdown import categories


# One colour per step-time category (mpu_lab.perf.breakdown.CATEGORY_ORDER): computation green,
# tensor-parallel collectives blues, data-parallel orange, pipeline p2p red, the rest greys.
BREAKDOWN_COLORS = {
    "compute": "#55a868", "tp all_reduce": "#1f4e79", "tp all_gather": "#4c72b0",
    "tp reduce_scatter": "#7fa7d6", "tp broadcast": "#b3cde3", "dp all_reduce": "#dd8452",
    "pp p2p": "#c44e52", "other": "#999999", "wait (barrier)": "#dddddd",
}


@styled
def plot_utilisation(runs: Dict[str, object], title: str = "", vmax: float = 100.0,
                     xlabel: str = "seconds") -> Figure:
    """Utilisation over time, one heat row per rank, one panel per run side by side
    (``label: mpu_lab.perf.utilisation.Utilisation``, e.g. cropped to the training window).
    Time is counted from each run's first sample; white where a rank had not started. Under
    CPU sampling a last row shows the whole machine (percent of all cores, every process)."""
    lanes = max(len(u.values) + 1 for u in runs.values())
    fig = new_figure(5.4 * len(runs) + 0.8, 0.42 * lanes + 1.5)
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


@styled
def plot_kernel_timeline(timelines, title: str = "") -> Figure:
    """What each rank's device did over time
    (:func:`mpu_lab.perf.kernel_timeline.kernel_timelines`):
    one row per rank, each bin a column split into compute (green, bottom), communication
    (red: NCCL kernels, or gloo ops, including the wait for a peer) and idle (light grey,
    top); the row's label gives the busy / comm / idle percent. ``timelines``: one run's list,
    or ``{label: list}`` for runs side by side (e.g. PP=4 with one micro-batch against DP=4)."""
    runs = timelines if isinstance(timelines, dict) else {"": timelines}
    fig = new_figure(5.4 * len(runs) + 0.6, 0.5 * max(len(t) for t in runs.values()) + 1.4)
    fig.set_layout_engine("constrained")
    axes = fig.subplots(1, len(runs), squeeze=False)[0]
    colors = (("compute", BREAKDOWN_COLORS["compute"]), ("comm", BREAKDOWN_COLORS["pp p2p"]),
              ("idle", "#e6e6e6"))
    for ax, (label, tls) in zip(axes, runs.items()):
        for row, tl in enumerate(tls):
            x = np.asarray(tl.bin_starts_ms())
            sizes = np.asarray(tl.compute) + np.asarray(tl.comm) + np.asarray(tl.idle)
            bottom = np.full(len(x), float(row) + 0.4)      # rows grow downwards
            for part, color in colors:
                h = 0.8 * np.asarray(getattr(tl, part)) / np.where(sizes > 0, sizes, 1.0)
                ax.bar(x, -h, bottom=bottom, width=tl.bin_us / 1e3, align="edge",
                       color=color, linewidth=0, label=part if row == 0 else None)
                bottom = bottom - h
        ax.set_yticks(range(len(tls)))
        ax.set_yticklabels([f"rank {tl.rank}\n{s['busy_pct']:.0f}/{s['comm_pct']:.0f}/"
                            f"{s['idle_pct']:.0f}%" for tl in tls for s in [tl.summary()]],
                           fontsize=8)
        ax.set_ylim(len(tls) - 0.5, -0.5)
        ax.set_xlabel(f"ms ({tls[0].device if tls else ''}; bins of "
                      f"{tls[0].bin_us / 1e3 if tls else 0:g} ms)")
        ax.set_title(f"{label}  busy/comm/idle" if label else "busy/comm/idle", loc="left")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, ["compute", "communication", "idle"][:len(names)], frameon=False,
               fontsize=7, ncol=3, loc="outside lower left")
    if title:
        fig.suptitle(title, x=0.01, ha="left")
    return fig


@styled
def plot_step_breakdown(runs: Dict[str, Sequence[dict]], title: str = "") -> Figure:
    """Where each rank's step time goes: one stacked bar per rank (milliseconds per step by
    category, from ``train_gpt.py --breakdown``), one panel per run (``label: reports``),
    sharing the time axis."""
    rows = sum(len(r) for r in runs.values())
    fig = new_figure(9.5, 0.32 * rows + 1.0 * len(runs) + 0.8)
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


@styled
def plot_bandwidth(rows: Sequence[dict], title: str = "") -> Figure:
    """Bus bandwidth (GB/s) against message size, one line per collective
    (rows of ``launch/bench_bandwidth.py``)."""
    fig = new_figure(7.0, 3.4)
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
