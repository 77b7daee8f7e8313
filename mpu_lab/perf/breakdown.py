"""Where a training step's time goes: the per-rank breakdowns of ``train_gpt.py --breakdown``.

Each rank's :class:`mpu_lab.perf.step_timer.StepTimer` (on top of
:class:`mpu_lab.perf.comm_timing.CommTimer`) reports the seconds of an iteration spent in each
kind of collective — tensor-parallel all-reduce / all-gather / reduce-scatter / broadcast,
data-parallel all-reduce, pipeline p2p — and the rest, which is computation. This module collects those reports (:func:`breakdowns`),
orders their categories (:func:`categories`), tabulates them (:func:`format_breakdown`) and
finds the timed window (:func:`training_window`).

What "waiting" means here: every collective and p2p call is synchronous, so the time a rank
spends inside one is the transfer *plus* the time it waits for the slowest member of its group
(or, for p2p, for the neighbouring stage to produce the activation: the pipeline bubble,
Narayanan et al. 2021 §2.2). The breakdown books both under the collective;
``--breakdown-barrier`` puts a barrier before each collective and books it as ``wait``, which
separates the two (at the price of an extra synchronisation).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from mpu_lab.perf.step_timer import CATEGORY_ORDER

__all__ = ["breakdowns", "categories", "format_breakdown", "training_window"]


def breakdowns(results: Sequence[Optional[dict]]) -> List[dict]:
    """The ``"breakdown"`` of every rank's ``train_gpt.py --breakdown`` report, rank order."""
    out = []
    for rank, result in enumerate(results):
        if not result or "breakdown" not in result:
            raise ValueError(f"rank {rank} reported no breakdown: run train_gpt.py with "
                             f"--breakdown")
        out.append(result["breakdown"])
    return out


def categories(reports: Sequence[dict]) -> List[str]:
    """The categories present in any rank's breakdown, in :data:`CATEGORY_ORDER`."""
    present = {k for r in reports for k in r["parts"]}
    return [c for c in CATEGORY_ORDER if c in present] + sorted(present - set(CATEGORY_ORDER))


def format_breakdown(reports: Sequence[dict], unit: str = "ms") -> str:
    """One line per rank: mean step time and each category's share of it (ms and %)."""
    scale = {"ms": 1e3, "s": 1.0, "us": 1e6}[unit]
    cats = categories(reports)
    head = (f"{'rank':>4} {'(tp,pp,dp)':>10} {'step ' + unit:>9} "
            + " ".join(f"{c:>17}" for c in cats))
    lines = [head]
    for r in reports:
        coord = f"({r['tp_rank']},{r['pp_rank']},{r['dp_rank']})"
        cells = []
        for c in cats:
            v = r["parts"].get(c, 0.0)
            cells.append(f"{v * scale:8.1f} ({100 * v / r['step_s']:3.0f}%)" if r["step_s"] > 0
                         else f"{'-':>17}")
        lines.append(f"{r['rank']:>4} {coord:>10} {r['step_s'] * scale:9.1f} "
                     + " ".join(f"{c:>17}" for c in cells))
    return "\n".join(lines)


def training_window(reports: Sequence[dict]) -> Tuple[float, float]:
    """``(earliest start, latest end)`` of the timed steps over all ranks (``time.time()``)."""
    starts = [r["window"][0] for r in reports if r["window"][0] is not None]
    ends = [r["window"][1] for r in reports if r["window"][1] is not None]
    if not starts:
        raise ValueError("no rank timed a step: train more iterations than the skipped ones")
    return min(starts), max(ends)

