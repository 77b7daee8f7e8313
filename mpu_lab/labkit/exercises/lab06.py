"""Lab 06's checks: the pipeline bubble's share of an iteration, and the micro-batches in flight."""
from __future__ import annotations

from typing import Any

from mpu_lab.labkit.exercises.common import Verdict, _as_int, _unanswered, _verdict
from mpu_lab.pipeline_parallel.timeline import analytic_bubble, simulate


def check_bubble_share(answer: Any, p: int, m: int, v: int = 1, tol: float = 0.005) -> Verdict:
    """The idle share of a pipeline iteration, ``(p-1)/(v·m + p-1)`` (within ``tol``)."""
    if _unanswered(answer, "the bubble's share of the iteration, a number between 0 and 1"):
        return Verdict(False)
    expected = analytic_bubble(p, m, v)
    try:
        value = float(answer)
    except (TypeError, ValueError):
        value = None
    return _verdict(value is not None and abs(value - float(expected["share"])) <= tol,
                    f"{expected['share']} = {float(expected['share']):.3f} of the iteration is "
                    f"idle (bubble / ideal time = (p-1)/(v m) = {expected['relative']}).",
                    f"{answer!r} is not it. Hint: the bubble lasts p-1 slots of 1/v, the work "
                    f"m slots of 1/v per stage; give bubble / (bubble + work).")


def check_peak_in_flight(answer: Any, schedule: str, p: int, m: int, stage: int = 0,
                         v: int = 1) -> Verdict:
    """Most micro-batches whose forward has run and backward not yet, on one stage."""
    if _unanswered(answer, "a number of micro-batches"):
        return Verdict(False)
    expected = simulate(schedule, p, m, v).peak_in_flight[stage]
    return _verdict(_as_int(answer) == expected,
                    f"stage {stage} holds at most {expected} micro-batches' activations under "
                    f"{schedule} with p = {p}, m = {m}.",
                    f"{answer!r} is not it. Hint: count the forwards a stage runs before its "
                    f"first backward; GPipe runs all m first, 1F1B only enough to fill the pipeline.")

