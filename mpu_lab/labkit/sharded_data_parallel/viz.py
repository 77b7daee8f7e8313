"""Lab 05's picture: what a rank keeps under each of Megatron-FSDP's strategies, counted in the
``train_gpt.py`` runs (solid) beside ZeRO's formula (hatched), stacked by term."""
from __future__ import annotations

from typing import Dict, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from mpu_lab.labkit.sharded_data_parallel import lessons
from mpu_lab.labkit.style import new_figure, styled
from mpu_lab.perf.cost_model import fsdp as fsdp_model

TERM_NAMES = {"param_bytes": "weights", "grad_bytes": "gradients",
              "optimizer_state_bytes": "Adam states"}
TERM_COLORS = {"param_bytes": "#4C72B0", "grad_bytes": "#DD8452",
               "optimizer_state_bytes": "#55A868"}


@styled
def plot_resident(runs: Dict[str, object], units: Sequence[int], d: int) -> Figure:
    """Per strategy, rank 0's counted KiB (left, solid) and the formula's for Ψ =
    ``sum(units)`` (right, hatched), stacked: weights, gradients, Adam's states."""
    psi = sum(units)
    fig = new_figure(7.0, 3.8)
    fig.set_layout_engine("constrained")
    ax = fig.add_subplot()
    for i, s in enumerate(lessons.STRATEGIES):
        bars = ((-0.19, lessons.resident(runs[s]), None),
                (0.19, fsdp_model.resident_bytes_per_rank(s, psi, d), "//"))
        for offset, values, hatch in bars:
            bottom = 0.0
            for key in lessons.KEYS:
                ax.bar(i + offset, values[key] / 1024, width=0.36, bottom=bottom,
                       color=TERM_COLORS[key], hatch=hatch, edgecolor="white", linewidth=0.5,
                       alpha=0.55 if hatch else 1.0)
                bottom += values[key] / 1024
    ax.set_xticks(np.arange(len(lessons.STRATEGIES)))
    ax.set_xticklabels([f"{s}\n{lessons.ZERO_NAMES[s]}" for s in lessons.STRATEGIES], fontsize=8)
    ax.set_ylabel("KiB on rank 0")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    handles = [Patch(color=TERM_COLORS[k], label=TERM_NAMES[k]) for k in lessons.KEYS] + [
        Patch(facecolor="white", edgecolor="#444444", label="counted (left)"),
        Patch(facecolor="white", edgecolor="#444444", hatch="//", label="formula (right)")]
    fig.legend(handles=handles, frameon=False, fontsize=7, ncol=5, loc="outside lower center")
    ax.set_title(f"What one rank keeps between steps, d = {d}", loc="left")
    return fig
