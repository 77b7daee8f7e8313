"""Lab 13 side by side with Megatron-core: Megatron-core's ``MoELayer`` against mpu_lab's
in a torchrun job of their own (``launch/megatron_core_moe.py``, whose ranks run
:mod:`mpu_lab.megatron_reference.moe`), and its report.

    results = run_side_by_side(["ep2/alltoall/top2", "ep2/allgather/top2"])   # a torchrun job
    print(format_results(results))
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

from mpu_lab import launcher
from mpu_lab.megatron_reference import runtime as mc
from mpu_lab.megatron_reference.moe import AUX_LOSS, DEFAULT_CASES, EXPERTS_PER_RANK, TOL, parse_case


def run_side_by_side(cases: Sequence[str] = DEFAULT_CASES, nproc: int = 4,
                     env: Optional[Dict[str, str]] = None) -> Dict[str, object]:
    """Launch ``launch/megatron_core_moe.py`` with ``nproc`` CPU ranks (gloo) and return
    ``{"version", "results": [per-rank list of per-case dicts]}``; ``{"skipped": reason}``
    where megatron-core cannot be imported. The cases are checked before anything starts."""
    for name in cases:
        parse_case(name, nproc)
    reason = mc.missing()
    if reason is not None:
        return {"skipped": reason}
    job = launcher.run("megatron_core_moe.py", ["--cases", *cases], nproc=nproc, show="none",
                       env={"MPU_LAB_BACKEND": "gloo", "MPU_LAB_DEVICE": "cpu", **(env or {})})
    return {"version": mc.version(), "results": job.results}


def worst(side_by_side: Dict[str, object], name: str) -> Dict[str, float]:
    """Case ``name``'s largest differences over the ranks: ``{out, dx, router, experts,
    own_init_out}`` (``own_init_out``: the smallest over the ranks); ``name`` as given to
    :func:`run_side_by_side` or as the results spell it (``tp2-ep2-etp2/...``)."""
    name = parse_case(name).name
    rows = [next(c for c in r["cases"] if c["case"] == name) for r in side_by_side["results"]]
    out = {k: max(r[k] for r in rows) for k in ("out", "dx", "router", "experts")}
    out["own_init_out"] = min(r["own_init_out"] for r in rows)
    out["same_names"] = all(not r["missing"] and not r["unexpected"] for r in rows)
    return out


def format_results(side_by_side: Dict[str, object], tol: float = TOL) -> str:
    """One line per case: the largest difference over the ranks of the output, the input
    gradient, the router's and the experts' gradients (shown as below ``tol`` or not, so the
    line reads the same on another CPU), and whether Megatron-core took every parameter by
    its name."""
    if "skipped" in side_by_side:
        return str(side_by_side["skipped"])
    ranks = side_by_side["results"]
    names = [c["case"] for c in ranks[0]["cases"]]
    wide = max(len("case"), *map(len, names)) + 2
    lines = [f"megatron-core {side_by_side['version']} vs mpu_lab, {len(ranks)} CPU ranks "
             f"(gloo), {EXPERTS_PER_RANK} experts per ep rank, aux loss {AUX_LOSS}:",
             "largest |difference| over the ranks; own init: Megatron-core's output with its own "
             "initial weights",
             f"  {'case':<{wide}}{'same names':<12}{'output':<10}{'input grad':<12}"
             f"{'router grad':<13}{'expert grads':<14}own init"]
    for name in names:
        w = worst(side_by_side, name)
        cells = ["yes" if w["same_names"] else "NO"] + [
            f"< {tol:g}" if w[k] < tol else f"{w[k]:.2g}" for k in ("out", "dx", "router",
                                                                   "experts")]
        own = "differs" if w["own_init_out"] > 1e-3 else "SAME (vacuous check)"
        lines.append(f"  {name:<{wide}}{cells[0]:<12}{cells[1]:<10}{cells[2]:<12}{cells[3]:<13}"
                     f"{cells[4]:<14}{own}")
    return "\n".join(lines)


def all_equal(side_by_side: Dict[str, object], tol: float = TOL) -> bool:
    """Every case within ``tol`` on every rank, the same names, and a non-vacuous check."""
    if "skipped" in side_by_side:
        return False
    names = [c["case"] for c in side_by_side["results"][0]["cases"]]
    return all(all(w[k] < tol for k in ("out", "dx", "router", "experts"))
               and w["same_names"] and w["own_init_out"] > 1e-3
               for w in (worst(side_by_side, n) for n in names))
