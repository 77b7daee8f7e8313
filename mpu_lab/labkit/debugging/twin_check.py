"""The check that catches the one fault that fails nothing, silent divergence:
:func:`compare_with_dense_twin` compares a run's logged losses with those of its dense TP=1 twin
(``launch/train_gpt.py --dense-twin``: rank 0 trains the twin from the run's initial weights,
:func:`mpu_lab.training.dense_twin_losses`). A correct tensor-parallel run matches it to fp32
rounding, iteration by iteration (lab 14); a run whose shards disagree drifts (lab 17)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence


@dataclasses.dataclass
class TwinVerdict:
    """What :func:`compare_with_dense_twin` found; true when the run matches its twin."""
    ok: bool
    rtol: float
    checked: int                          # logged iterations compared
    max_rel_diff: float                   # over the iterations that matched
    iteration: Optional[int] = None       # the first logged iteration that drifts
    loss: Optional[float] = None          # the run's loss there
    dense_loss: Optional[float] = None    # the twin's
    rel_diff: Optional[float] = None

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return (f"Matches the dense twin: {self.checked} logged iterations within rtol "
                    f"{self.rtol:.0e} (largest relative difference {self.max_rel_diff:.1e}).")
        before = (f"; the {self.checked - 1} before it matched (largest relative difference "
                  f"{self.max_rel_diff:.1e})" if self.checked > 1 else "")
        return (f"Drifts from the dense twin at iteration {self.iteration}: loss "
                f"{self.loss:.6f} vs the twin's {self.dense_loss:.6f}, relative difference "
                f"{self.rel_diff:.1e} > rtol {self.rtol:.0e}{before}.")


def _rank0(metrics):
    """A job (anything with ``.results``: rank 0's report) or a report, as given."""
    return metrics.results[0] if hasattr(metrics, "results") else metrics


def compare_with_dense_twin(metrics, dense_losses: Optional[Sequence] = None,
                            rtol: float = 1e-5) -> TwinVerdict:
    """Compare a run's logged losses with its dense twin's, iteration by iteration.

    ``metrics``: the run's logged records (``job.results[0]["metrics"]``, or that result dict
    itself), each with ``iteration`` and ``lm_loss`` (the mean over the iterations since the
    previous record); ``dense_losses``: the twin's loss per iteration, iteration 1 first
    (``job.results[0]["dense_losses"]`` with ``--dense-twin``). Returns a
    :class:`TwinVerdict`: the first iteration whose relative difference exceeds ``rtol``,
    by how much; true when none does. ``metrics`` may also be the job
    (:class:`~mpu_lab.launcher.LaunchResult`); ``dense_losses`` left out: the report's own
    ``"dense_losses"``."""
    report = _rank0(metrics)
    if dense_losses is None:
        if not (isinstance(report, dict) and "dense_losses" in report):
            raise ValueError("no dense losses: run train_gpt.py with --dense-twin, or pass "
                             "dense_losses (the twin's loss per iteration)")
        dense_losses = report["dense_losses"]
    records = list(report["metrics"] if isinstance(report, dict) else report)
    if not records:
        raise ValueError("no logged iterations to compare (metrics is empty)")
    dense = [float(x["lm_loss"]) if isinstance(x, dict) else float(x) for x in dense_losses]
    previous, worst, checked = 0, 0.0, 0
    for record in records:
        it = int(record["iteration"])
        if it > len(dense):
            raise ValueError(f"the run logged iteration {it} but the twin has only "
                             f"{len(dense)} losses")
        window = dense[previous:it]
        expected = sum(window) / len(window)
        got = float(record["lm_loss"])
        rel = abs(got - expected) / abs(expected) if expected else abs(got)
        checked += 1
        if not rel <= rtol or math.isnan(got):
            return TwinVerdict(False, rtol, checked, worst, it, got, expected, rel)
        worst, previous = max(worst, rel), it
    return TwinVerdict(True, rtol, checked, worst)
