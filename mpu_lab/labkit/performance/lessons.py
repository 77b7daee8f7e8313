"""Lab 15's schedule figures, printed in a reveal cell (so that the code a learner sees above a
prediction does not show the formula that answers it)."""
from __future__ import annotations

from mpu_lab.perf.cost_model.counts import bubble_fraction


def schedule_figures(p: int, m_fix: int) -> str:
    """What 1F1B's schedule alone gives the bad run (one micro-batch) and the remedy (``m_fix``
    micro-batches) on ``p`` stages of equal work, a device each: each stage's busy share
    m / (m + p - 1), the bubble (p - 1) / m of the work, and the speed-ups over the bad run
    (the remedy's p·m / (m + p - 1); data parallelism's p)."""
    lines = [f"p = {p}, m = {m}: each stage busy m/(m+p-1) = {m / (m + p - 1):.0%} of the time; "
             f"bubble (p-1)/m = {bubble_fraction(p, m):.2f} of the work" for m in (1, m_fix)]
    lines.append(f"by the schedule alone: the remedy {p * m_fix / (m_fix + p - 1):.2f}x and DP "
                 f"{p}x the bad run's speed")
    return "\n".join(lines)
