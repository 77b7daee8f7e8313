"""The backward pass of Megatron's linear on a timeline: the gradient GEMMs on one lane, the
collectives (from issued to known finished) on another, overlapped and serial side by side
(``launch/linear_overlap.py`` measures them; :mod:`mpu_lab.perf.linear_overlap`)."""
from __future__ import annotations

from typing import Dict

from matplotlib.figure import Figure

from mpu_lab.labkit.viz.style import new_figure, styled

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
