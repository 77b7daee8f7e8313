"""Lab 04 side by side with Megatron-core: what ``launch/megatron_core_ddp.py``'s ranks
report (:mod:`mpu_lab.megatron_reference.ddp`), as one table in rank order."""
from __future__ import annotations

from typing import Dict, List

from mpu_lab.megatron_reference.ddp import TOL, worst



def _num(v) -> str:
    """A difference as the lab prints it: "-" (not compared), "<= 1e-6" (fp32 rounding: the
    exact digits change with the CPU and thread count), or its order of magnitude."""
    return "-" if v is None else ("<= 1e-6" if v <= 1e-6 else f"{v:.0e}")


def format_ddp_results(results: List[Dict[str, object]], tol: float = TOL) -> str:
    """The job's reports as a table: per mode and library, the largest difference (over the
    ranks) from the single-process reference, of the gradients and of the parameters after
    the last step (see :func:`_num`), and whether all are within ``tol``."""
    if results and "skipped" in results[0]:
        return results[0]["skipped"]
    first = results[0]
    steps = len(first["modes"][0]["params"]["mpu_lab"])
    lines = [f"megatron-core {first['megatron_core']} and mpu_lab at d = {first['d']}, "
             f"max |library - single-process reference| over the ranks:",
             f"{'mode':<33}{'library':<15}{'buckets':>8}{'gradients':>11}"
             f"{f'params after {steps} Adam steps':>29}"]
    for i, mode in enumerate(m["mode"] for m in first["modes"]):
        for lib in ("megatron-core", "mpu_lab"):
            grads = [r["modes"][i]["grad"].get(lib) for r in results]
            grad = None if grads[0] is None else max(grads)
            par = max(r["modes"][i]["params"][lib][-1] for r in results)
            lines.append(f"{mode if lib == 'megatron-core' else '':<33}{lib:<15}"
                         f"{first['modes'][i]['buckets'][lib]:>8}{_num(grad):>11}"
                         f"{_num(par):>29}")
    ok = worst(results) <= tol
    lines.append(f"every difference within {tol:g} (fp32 rounding): {'yes' if ok else 'NO'};\n"
                 f"'-': with the distributed optimizer a rank holds only its shard's average")
    return "\n".join(lines)
