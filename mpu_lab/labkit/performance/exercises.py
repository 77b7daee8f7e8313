"""Lab 15's checks: how much faster a fuller pipeline is by its schedule alone, and the fewest
micro-batches for a bubble budget. Lab 16 imports the two checks against the cost model at
scale from here: the fastest (t, p) and the communication that dominates an iteration."""
from __future__ import annotations

import fractions
from typing import Any

from mpu_lab.labkit.verdict import Verdict, as_floats, as_int, as_int_list, unanswered, verdict
from mpu_lab.perf.cost_model import bubble_fraction, predict_iteration
from mpu_lab.perf import explore
from mpu_lab.labkit.notebooks import leaks


def check_best_config(answer: Any, model, cluster, num_gpus: int, global_batch_size: int,
                      tol: float = 0.05) -> Verdict:
    """A ``(t, p)`` whose best configuration (over the micro-batch sizes) fits in memory and is
    predicted within ``tol`` of the fastest one :func:`mpu_lab.perf.explore` finds."""
    if unanswered(answer, "a pair (t, p): tensor- and pipeline-parallel sizes"):
        return Verdict(False)
    result = explore(model, cluster, num_gpus, global_batch_size)
    best = result.best
    pair = as_int_list(answer)
    mine = [c for c in result.candidates
            if pair is not None and len(pair) == 2 and (c.config.tp, c.config.pp) == tuple(pair)]
    chosen = min(mine, key=lambda c: (not c.fits, c.prediction.total_s)) if mine else None
    fast = chosen is not None and chosen.fits and \
        chosen.prediction.total_s <= (1 + tol) * best.prediction.total_s
    b, fastest = best.config, best.prediction.total_s
    if chosen is None:
        mine = (f"{answer!r} is not a valid (t, p) for {num_gpus} GPUs with batch "
                f"{global_batch_size}.")
    else:
        mine = (f"(t={chosen.config.tp}, p={chosen.config.pp}): at best "
                f"{chosen.prediction.total_s:.2f} s per iteration"
                f"{'' if chosen.fits else ', and it does not fit in memory'}.")
    return verdict(fast,
                    f"{mine} That is within {tol:.0%} of the fastest, t={b.tp}, p={b.pp}, "
                    f"d={b.dp}, b={b.b}: {fastest:.2f} s.",
                    f"{mine} The fastest takes {fastest:.2f} s. Hint: keep t within a node "
                    f"({cluster.gpus_per_node} GPUs), then use the fewest pipeline stages that "
                    f"fit in memory; explore() ranks them all.",
                    answer=f"the fastest is t={b.tp}, p={b.pp} (d={b.dp}, b={b.b}): "
                           f"{fastest:.2f} s per iteration; any (t, p) predicted within "
                           f"{tol:.0%} of it counts (explore(...).table() ranks them all).")


def check_pipeline_speedup(answer: Any, p: int, m: int, rel_tol: float = 0.02) -> Verdict:
    """How many times faster a pipeline of ``p`` stages runs a step fed ``m`` micro-batches than
    fed the whole batch as one, by the schedule alone: a device per stage, stages of equal
    work, nothing lost to smaller matrix products. One micro-batch: the stages run one after
    the other, the whole step's work W; m of them (1F1B or GPipe): (m + p - 1) slots of
    W/(p m) each. The answer, p m / (m + p - 1), within ``rel_tol``."""
    if p < 2 or m < 1:
        raise ValueError(f"need p >= 2 stages and m >= 1 micro-batches, got p={p}, m={m}")
    if unanswered(answer, "a number: how many times faster"):
        return Verdict(False)
    expected = p * m / (m + p - 1)
    got = as_floats(answer)
    ok = got is not None and len(got) == 1 and abs(got[0] - expected) <= rel_tol * expected
    return verdict(ok,
                   f"{expected:.2f}x: one micro-batch takes p = {p} stage-times of the whole "
                   f"batch; m = {m} take (m + p - 1)/m = {(m + p - 1) / m:.3f} of one "
                   f"(p m / (m + p - 1) = {p * m}/{m + p - 1}).",
                   f"{answer!r} is not it. Hint: with one micro-batch, how many stages work at "
                   f"any moment? With m, how long does the pipeline take to fill and drain, "
                   f"counted in micro-batch slots?")


def check_min_microbatches(answer: Any, p: int, max_bubble: float, v: int = 1) -> Verdict:
    """The fewest micro-batches m for which the bubble, relative to the ideal time
    ((p-1)/(v·m), :func:`mpu_lab.perf.bubble_fraction`), is at most ``max_bubble``."""
    if unanswered(answer, "a number of micro-batches"):
        return Verdict(False)
    m = 1
    while bubble_fraction(p, m, v) > max_bubble + 1e-12:
        m += 1
    return verdict(as_int(answer) == m,
                    f"m = {m}: the bubble is (p-1)/(v m) = {p - 1}/({v}·{m}) = "
                    f"{bubble_fraction(p, m, v):.4f} of the ideal time (m = {m - 1} gives "
                    f"{bubble_fraction(p, max(m - 1, 1), v):.4f}).",
                    f"{answer!r} is not it. Hint: solve (p-1)/(v m) <= {max_bubble} for the "
                    f"smallest whole m.")


_COMM_NAMES = {"tp": "tp", "tensor": "tp", "pp": "pp", "pipeline": "pp", "p2p": "pp",
               "dp": "dp", "data": "dp"}


def _communication_times(pred) -> dict:
    return {"tp": pred.tp_comm_s, "pp": pred.pp_p2p_s, "dp": pred.dp_comm_s}


def expected_dominant_communication(model, config, cluster) -> str:
    """The answer :func:`check_dominant_communication` grades: ``"tp"``, ``"pp"`` or ``"dp"``."""
    times = _communication_times(predict_iteration(model, config, cluster))
    return max(times, key=times.get)


def check_dominant_communication(answer: Any, model, config, cluster) -> Verdict:
    """Which communication the cost model puts the most time on for ``config``: ``"tp"``
    (tensor-parallel collectives), ``"pp"`` (pipeline send/recv) or ``"dp"`` (the exposed
    data-parallel gradient all-reduce) — from :func:`mpu_lab.perf.predict_iteration`."""
    if unanswered(answer, '"tp", "pp" or "dp"'):
        return Verdict(False)
    pred = predict_iteration(model, config, cluster)
    times = _communication_times(pred)
    expected = max(times, key=times.get)
    given = _COMM_NAMES.get(str(answer).strip().lower().split()[0] if str(answer).strip() else "")
    shares = ", ".join(f"{k} {v / pred.total_s:.1%}" for k, v in times.items())
    return verdict(given == expected,
                    f"{expected}: {shares} of the iteration.",
                    f"{answer!r} is not it. Hint: with t = {config.tp}, p = {config.pp}, "
                    f"d = {config.dp}, which groups exist at all, and which of them moves the "
                    f"most bytes per iteration over the slowest link?")


# --------------------------------------------------------------------------- answers
# What lab 15's graded questions answer, for the leak check (mpu_lab.labkit.notebooks.leaks),
# as the checks compute them: the first at the CPU profile's 2 ranks and 8 micro-batches (the
# lab is stored run on it).
def _min_microbatches(p: int, max_bubble: float, v: int = 1) -> int:
    m = 1
    while bubble_fraction(p, m, v) > max_bubble + 1e-12:
        m += 1
    return m


leaks.declare_answers([
    ("15", "remedy speed-up p=2 m=8", [fractions.Fraction(2 * 8, 8 + 2 - 1)], "check_pipeline_speedup(", 0),
    ("15", "fewest micro-batches", [_min_microbatches(8, 0.05)], "check_min_microbatches("),
    ("15", "speed-up p=4 m=8", [fractions.Fraction(4 * 8, 8 + 4 - 1)], "check_pipeline_speedup(", 1),
])
