"""Lab 03: where a rank's memory goes — measured next to predicted, term by term.

The rows come from :func:`mpu_lab.perf.memory_breakdown.run_memory_breakdown` (dicts with ``config``,
``optimizer``, ``rank``, ``term``, ``measured``, ``predicted``): :func:`plot_memory_breakdown`
draws one pair of stacked bars per configuration and optimizer (measured solid, predicted
hatched), :func:`print_optimizer_saving` prints what the distributed optimizer saves.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from mpu_lab.labkit.viz.style import new_figure, styled
from mpu_lab.perf.memory_breakdown import TERMS

TERM_COLORS = {"parameters": "#4c72b0", "gradients": "#55a868", "optimizer": "#c44e52",
               "activations": "#dd8452"}
_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3}


def _groups(rows: Sequence[dict]) -> Dict[Tuple[str, str], Dict[int, Dict[str, dict]]]:
    """``{(config, optimizer): {rank: {term: row}}}`` in the rows' order."""
    out: Dict[Tuple[str, str], Dict[int, Dict[str, dict]]] = {}
    for r in rows:
        if r["term"] in TERMS:
            out.setdefault((r["config"], r["optimizer"]), {}).setdefault(r["rank"], {})[
                r["term"]] = r
    return out


def busiest_ranks(rows: Sequence[dict]) -> Dict[Tuple[str, str], int]:
    """The rank with the largest measured total per (configuration, optimizer); the lowest
    such rank on a tie."""
    return {key: max(sorted(ranks), key=lambda k: sum(r["measured"] for r in ranks[k].values()))
            for key, ranks in _groups(rows).items()}


@styled
def plot_memory_breakdown(rows: Sequence[dict], rank: Optional[int] = None, unit: str = "KiB",
                          title: str = "") -> Figure:
    """One pair of bars per configuration and optimizer: the measured bytes (solid) and the
    cost model's prediction (hatched) of one rank, stacked by term (parameters, gradients,
    optimizer states, activations). ``rank``: which rank (default: each pair's busiest,
    named under its bars)."""
    if unit not in _UNITS:
        raise ValueError(f"unit must be one of {list(_UNITS)}, got {unit!r}")
    groups = _groups(rows)
    if not groups:
        raise ValueError("no rows with a memory term: pass the rows of run_memory_breakdown")
    chosen = busiest_ranks(rows) if rank is None else {key: rank for key in groups}
    for key, r in chosen.items():
        if r not in groups[key]:
            raise ValueError(f"rank {r} is not in the rows of {key[0]} {key[1]}; ranks there: "
                             f"{sorted(groups[key])}")
    fig = new_figure(max(6.0, 1.25 * len(groups) + 1.5), 4.2)
    fig.set_layout_engine("constrained")
    ax = fig.add_subplot()
    scale = _UNITS[unit]
    labels: List[str] = []
    for i, (key, ranks) in enumerate(groups.items()):
        terms = ranks[chosen[key]]
        for offset, kind, hatch in ((-0.19, "measured", None), (0.19, "predicted", "//")):
            bottom = 0.0
            for term in TERMS:
                value = terms[term][kind] / scale if term in terms else 0.0
                ax.bar(i + offset, value, width=0.36, bottom=bottom, color=TERM_COLORS[term],
                       hatch=hatch, edgecolor="white", linewidth=0.5,
                       alpha=0.55 if hatch else 1.0)
                bottom += value
        labels.append(f"{key[0]}\n{key[1]}\nrank {chosen[key]}")
    ax.set_xticks(np.arange(len(groups)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel(f"{unit} on the rank")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    handles = [Patch(color=TERM_COLORS[t], label=t) for t in TERMS] + [
        Patch(facecolor="white", edgecolor="#444444", label="measured (left)"),
        Patch(facecolor="white", edgecolor="#444444", hatch="//", label="predicted (right)")]
    fig.legend(handles=handles, frameon=False, fontsize=7, ncol=6, loc="outside lower center")
    ax.set_title(title or "Memory per rank: measured (solid) vs predicted (hatched)",
                 loc="left")
    return fig


def print_optimizer_saving(rows: Sequence[dict]) -> None:
    """Per configuration, the optimizer states of one rank (the busiest under AdamW) with
    AdamW and with the distributed optimizer, measured, and their ratio next to d."""
    groups = _groups(rows)
    busiest = busiest_ranks(rows)
    configs = list(dict.fromkeys(config for config, _ in groups))
    print(f"{'config':<14}{'rank':>5}{'AdamW KiB':>12}{'distributed KiB':>17}{'ratio':>8}"
          f"{'d':>4}")
    for config in configs:
        plain, dist = groups.get((config, "AdamW")), groups.get((config, "distributed"))
        if plain is None or dist is None:
            continue
        rank = busiest[(config, "AdamW")]
        a = plain[rank]["optimizer"]["measured"]
        b = dist[rank]["optimizer"]["measured"]
        print(f"{config:<14}{rank:>5}{a / 1024:>12.1f}{b / 1024:>17.1f}{a / b:>8.2f}"
              f"{plain[rank]['optimizer']['dp']:>4}")
