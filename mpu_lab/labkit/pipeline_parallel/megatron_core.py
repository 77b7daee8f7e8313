"""Lab 11 side by side with Megatron-core: its pipeline schedules against mpu_lab's in a
torchrun job of their own (``launch/megatron_core_schedules.py``, whose ranks run
:mod:`mpu_lab.megatron_reference.schedules`), and its report.

    results = run_side_by_side()          # a torchrun job of 2 CPU ranks
    print(format_results(results))
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

from mpu_lab import launcher
from mpu_lab.megatron_reference import runtime as mc
from mpu_lab.megatron_reference.schedules import CASES, TOL


# --------------------------------------------------------------------------- driver side
def run_side_by_side(cases: Sequence[str] = ("1f1b", "interleaved"), num_microbatches: int = 4,
                     nproc: int = 2, env: Optional[Dict[str, str]] = None) -> Dict[str, object]:
    """Launch ``launch/megatron_core_schedules.py`` with ``nproc`` ranks (pipeline stages) on
    the CPU (gloo) and return ``{"version": ..., "results": [per-rank list of per-case
    dicts]}``; ``{"skipped": reason}`` where megatron-core cannot be imported."""
    reason = mc.missing()
    if reason is not None:
        return {"skipped": reason}
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; the cases are {list(CASES)}")
    if nproc < 2:
        raise ValueError(f"nproc must be at least 2 (pipeline stages), got {nproc}")
    job = launcher.run("megatron_core_schedules.py",
                       ["--cases", *cases, "--num-microbatches", str(num_microbatches)],
                       nproc=nproc, show="none",
                       env={"MPU_LAB_BACKEND": "gloo", "MPU_LAB_DEVICE": "cpu", **(env or {})})
    return {"version": mc.version(), "results": job.results}


def format_results(side_by_side: Dict[str, object], cases: Optional[Sequence[str]] = None,
                   tol: float = TOL) -> str:
    """One line per case (all that ran, or ``cases`` in that order): the largest gradient
    differences over the stages. The installed release is not in it (see ``"version"``), so
    the text is the same with 0.16 and 0.19."""
    if "skipped" in side_by_side:
        return str(side_by_side["skipped"])
    ranks = side_by_side["results"]
    names = cases or [r["case"] for r in ranks[0]["cases"]]
    wide = max(len("schedule"), *(len(CASES[name].label) for name in names))
    lines = [f"p = {len(ranks)} stages on the CPU (gloo); largest |difference| of the stage "
             f"gradients over all stages:",
             f"{'schedule':<{wide}} {'Megatron-core':>13} {'Megatron-core':>13} {'mpu_lab':>7}",
             f"{'':<{wide}} {'vs mpu_lab':>13} {'vs the twin':>13} {'vs twin':>7}"]
    for name in names:
        rows = [next(c for c in r["cases"] if c["case"] == name) for r in ranks]
        worst = [max(r[key] for r in rows)
                 for key in ("megatron_vs_mpu_lab", "megatron_vs_twin", "mpu_lab_vs_twin")]
        lines.append(f"{CASES[name].label:<{wide}} {_num(worst[0], tol):>13} "
                     f"{_num(worst[1], tol):>13} {_num(worst[2], tol):>7}")
    return "\n".join(lines)


def _num(value: float, tol: float = TOL) -> str:
    """A difference as text that survives another CPU: below ``tol`` only that it is."""
    return f"< {tol:.0e}" if value <= tol else f"{value:.2f}"
