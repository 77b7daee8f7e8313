"""Lab 04's pictures: data parallelism on a timeline, from a real run
(:mod:`mpu_lab.perf.dp_overlap`) and as predicted (:mod:`mpu_lab.perf.cost_model.dp_overlap`);
where a rank's memory goes, measured next to predicted, term by term
(:mod:`mpu_lab.perf.memory_breakdown`)."""
from __future__ import annotations

import statistics

from typing import Optional, Sequence
from typing import Dict, List, Tuple

from matplotlib.figure import Figure
import numpy as np
from matplotlib.patches import Patch

from mpu_lab.labkit.performance.viz import BREAKDOWN_COLORS
from mpu_lab.perf.cost_model.dp_overlap import StepTimeline
from mpu_lab.labkit.style import new_figure, styled
from mpu_lab.perf.memory_breakdown import TERMS

_COMPUTE, _COMM = BREAKDOWN_COLORS["compute"], BREAKDOWN_COLORS["dp all_reduce"]


def timeline_rows(result, mode: str, step: int = -1, ranks: Optional[Sequence[int]] = None):
    """``(row label, [(start_ms, end_ms, text)])`` for one mode's ``step``, top to bottom:
    per rank (default all) its backward row, then one row per bucket (reduction issued ->
    done). Times are on one clock for all ranks (ms from the earliest backward start of that
    step: the ranks of one host share ``time.perf_counter``'s monotonic clock)."""
    records = [rec["steps"][step] for rec in result.mode(mode)]
    origin = min(s["t0_s"] for s in records)
    rows = []
    for rank, s in enumerate(records):
        if ranks is not None and rank not in ranks:
            continue
        shift = 1e3 * (s["t0_s"] - origin)
        rows.append((f"rank {rank} backward",
                     [(shift, shift + s["backward_ms"], f"{s['backward_ms']:.0f} ms")]))
        for sync in sorted(s["syncs"], key=lambda x: (x["chunk"], x["bucket"])):
            rows.append((f"rank {rank} bucket {sync['bucket']}",
                         [(shift + sync["start_ms"], shift + sync["done_ms"],
                           f"b{sync['bucket']}")]))
    return rows


@styled
def plot_dp_timeline(result, modes: Optional[Sequence[str]] = None, step: int = -1,
                     ranks: Optional[Sequence[int]] = None, title: str = "") -> Figure:
    """One panel per mode (default: every mode of ``result``, top to bottom, one time axis):
    the last timed step (``step``) of each rank: its backward, then its buckets' reductions.
    ``ranks``: the ranks drawn (default all, up to 4: ranks 0, 1, d-2, d-1 beyond; the axis
    label says which). Each panel's title gives that step's exposed communication per rank
    drawn (ms after backward's end)."""
    modes = list(modes or result.modes)
    if ranks is None:
        ranks = range(result.d) if result.d <= 4 else (0, 1, result.d - 2, result.d - 1)
    ranks = sorted(set(ranks))
    if not ranks or not all(0 <= r < result.d for r in ranks):
        raise ValueError(f"ranks {ranks} must be a non-empty subset of 0..{result.d - 1}")
    per_mode = {m: timeline_rows(result, m, step, ranks) for m in modes}
    n_rows = max(len(rows) for rows in per_mode.values())
    fig = new_figure(9.5, 1.0 + len(modes) * (0.22 * n_rows + 0.5))
    fig.set_layout_engine("constrained")
    axes = fig.subplots(len(modes), 1, sharex=True, squeeze=False)[:, 0]
    for ax, mode in zip(axes, modes):
        rows = per_mode[mode]
        records = [rec["steps"][step] for rec in result.mode(mode)]
        origin = min(s["t0_s"] for s in records)
        for y, (label, spans) in enumerate(rows):
            is_compute = label.endswith("backward")
            for start, end, text in spans:
                ax.barh(y, end - start, left=start, height=0.8 if is_compute else 0.7,
                        color=_COMPUTE if is_compute else _COMM, edgecolor="white",
                        linewidth=0.3)
                ax.text(start + 0.01 * (end - start), y, text, va="center", fontsize=8,
                        color="white" if is_compute else "black")
        for rank, s in enumerate(records):        # wait() returned; backward's end
            if rank not in ranks:
                continue
            shift = 1e3 * (s["t0_s"] - origin)
            first = next(y for y, (label, _) in enumerate(rows)
                         if label == f"rank {rank} backward")
            for k, sync in enumerate(sorted(s["syncs"], key=lambda x: (x["chunk"], x["bucket"]))):
                ax.hlines(first + 1 + k, shift + sync["done_ms"], shift + sync["end_ms"],
                          color=_COMM, linewidth=0.8)
            ax.vlines(shift + s["backward_ms"], first - 0.5, first + 0.5 + len(s["syncs"]),
                      color="black", linewidth=0.8, linestyle=":")
            if first:
                ax.axhline(first - 0.5, color="#cccccc", linewidth=0.5)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([label if label.endswith("backward") else label.split(" ", 2)[2]
                            for label, _ in rows], fontsize=8)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        exposed = ", ".join(f"{records[r]['exposed_ms']:.1f}" for r in ranks)
        typical = statistics.fmean(statistics.median(s["exposed_ms"] for s in rec["steps"])
                                   for rec in result.mode(mode))
        ax.set_title(f"{mode}: exposed communication of the step drawn, per rank {exposed} ms "
                     f"(printed above: median of the steps, mean of the ranks {typical:.1f} ms)",
                     loc="left", fontsize=8)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    shown = "" if len(ranks) == result.d else f"; ranks {', '.join(map(str, ranks))} shown"
    axes[-1].set_xlabel(f"ms from the first backward start of the step (d = {result.d}, "
                        f"{result.device}{shown})\ngreen: backward; orange: a bucket's reduction, "
                        f"issued to done (thin line: until waited for); dotted: backward's end")
    if title:
        fig.suptitle(title, x=0.01, ha="left")
    return fig


@styled
def plot_predicted_dp_timeline(timelines, title: str = "") -> Figure:
    """:func:`mpu_lab.perf.cost_model.dp_overlap.predict_dgx_h100`'s two steps, one panel each
    (without, with overlap), labelled PREDICTED: backward (green) and the buckets'
    all-reduces one after another on the communication channel (orange, alternate shades),
    in ms from backward's start; the dotted line is backward's end."""
    fig = new_figure(9.5, 2.8)
    fig.set_layout_engine("constrained")
    axes = fig.subplots(2, 1, sharex=True)
    for ax, flag in zip(axes, (False, True)):
        t: StepTimeline = timelines[flag]
        ax.barh(1, 1e3 * t.backward_s, color=_COMPUTE, height=0.7)
        ax.text(1.0, 1, f"backward {1e3 * t.backward_s:.0f} ms", va="center", fontsize=8,
                color="white")
        for i, (start, end) in enumerate(zip(t.start_s, t.end_s)):
            ax.barh(0, 1e3 * (end - start), left=1e3 * start, height=0.7, color=_COMM,
                    alpha=1.0 if i % 2 else 0.6, edgecolor="white", linewidth=0.2)
        ax.axvline(1e3 * t.backward_s, color="black", linestyle=":", linewidth=0.8)
        ax.set_yticks([0, 1])
        ax.set_yticklabels([f"{len(t.start_s)} all-reduces", "backward"], fontsize=8)
        ax.set_title(f"PREDICTED, {'with' if flag else 'without'} overlap: exposed "
                     f"{1e3 * t.exposed_s:.1f} ms, step (backward + exposed) "
                     f"{1e3 * t.step_s:.0f} ms", loc="left", fontsize=9)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xlabel(f"ms from backward's start; {timelines[True].label}")
    if title:
        fig.suptitle(title, x=0.01, ha="left")
    return fig

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
