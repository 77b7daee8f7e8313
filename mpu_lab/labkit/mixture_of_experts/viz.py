"""Lab 13: pictures of a mixture-of-experts layer.

:func:`plot_routing` (the router's probabilities, token by expert, with the chosen experts
marked, and the tokens each expert gets), :func:`plot_capacity` (tokens per expert against
the capacity, kept and dropped), :func:`plot_loads` (the busiest expert's load over training
steps). The expert groups on lab 01's picture are
:func:`mpu_lab.labkit.rank_groups.viz.plot_group_families` with ``ep``.
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch
from matplotlib.figure import Figure

from mpu_lab.labkit.style import group_colors, new_figure, styled


def _clean(ax) -> None:
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


@styled
def plot_routing(probs: torch.Tensor, routing_map: torch.Tensor, title: str = "") -> Figure:
    """Left: ``probs`` ``[tokens, E]`` as shades, a dot on each (token, chosen expert). Right:
    the tokens each expert gets (the column sums of ``routing_map``)."""
    probs, routing_map = probs.detach().float().cpu(), routing_map.cpu()
    tokens, experts = probs.shape
    fig = new_figure(10.0, max(2.6, 0.22 * tokens + 1.2))
    ax, bars = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.2, 1.0]})
    ax.imshow(probs.numpy(), cmap="Blues", vmin=0, vmax=1, aspect="auto")
    t, e = routing_map.nonzero(as_tuple=True)
    ax.scatter(e.tolist(), t.tolist(), s=14, color="#c0392b", label="chosen")
    ax.set_xlabel("expert")
    ax.set_ylabel("token")
    ax.set_xticks(range(experts))
    ax.set_title(title or "router probabilities (shade), top-k choices (dots)", loc="left",
                 fontsize=10)
    counts = routing_map.sum(dim=0).tolist()
    bars.bar(range(experts), counts, color=group_colors(experts))
    mean = sum(counts) / experts
    bars.axhline(mean, color="#555555", linestyle="--", linewidth=1)
    bars.text(experts - 0.5, mean, " mean", va="bottom", ha="right", fontsize=8, color="#555555")
    bars.set_xticks(range(experts))
    bars.set_xlabel("expert")
    bars.set_ylabel("tokens routed to it")
    bars.set_title("tokens per expert", loc="left", fontsize=10)
    _clean(bars)
    fig.tight_layout()
    return fig


@styled
def plot_capacity(before: Sequence[int], kept: Sequence[int], capacity: int,
                  title: str = "") -> Figure:
    """Tokens routed to each expert (full bar), kept (solid) and dropped (hatched), with the
    capacity as a line."""
    experts = len(before)
    fig = new_figure(6.5, 3.0)
    ax = fig.add_subplot()
    colors = group_colors(experts)
    ax.bar(range(experts), kept, color=colors, label="kept")
    dropped = [b - k for b, k in zip(before, kept)]
    ax.bar(range(experts), dropped, bottom=kept, color="white", edgecolor=colors, hatch="//",
           label="dropped")
    ax.axhline(capacity, color="#c0392b", linewidth=1.2)
    ax.text(experts - 0.5, capacity, f" capacity {capacity}", va="bottom", ha="right",
            fontsize=8, color="#c0392b")
    ax.set_xticks(range(experts))
    ax.set_xlabel("expert")
    ax.set_ylabel("tokens")
    ax.legend(frameon=False, fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 0.9))
    ax.set_title(title, loc="left", fontsize=10)
    _clean(ax)
    fig.tight_layout()
    return fig


@styled
def plot_loads(curves: Dict[str, Sequence[float]], worst: float, title: str = "") -> Figure:
    """The busiest expert's load over the mean load, step by step, one curve per label; 1 is
    a uniform load, ``worst`` (E / k) every token on the same k experts."""
    fig = new_figure(8.0, 3.2)
    ax = fig.add_subplot()
    colors = group_colors(len(curves))
    for color, (label, loads) in zip(colors, curves.items()):
        ax.plot(range(len(loads)), list(loads), color=color, label=label, linewidth=1.6)
    ax.axhline(1.0, color="#555555", linestyle="--", linewidth=1)
    ax.axhline(worst, color="#c0392b", linestyle=":", linewidth=1)
    ax.set_ylim(0.8, worst + 0.3)
    ax.set_xlabel("training step")
    ax.set_ylabel("busiest expert / mean")
    ax.text(0, 1.0, " uniform", va="bottom", fontsize=8, color="#555555")
    ax.text(0, worst, f" all tokens on k experts (E/k = {worst:g})", va="bottom", fontsize=8,
            color="#c0392b")
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(title, loc="left", fontsize=10)
    _clean(ax)
    fig.tight_layout()
    return fig
