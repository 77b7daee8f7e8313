"""Labs 06-08 side by side with Megatron-core: the per-rank numbers of
``launch/megatron_core_side_by_side.py`` (:mod:`mpu_lab.megatron_reference.layers` on each
rank) as small tables in rank order."""
from __future__ import annotations

from typing import Dict, List, Optional

from mpu_lab.megatron_reference.layers import LINEAR_KINDS


# --------------------------------------------------------------------------- the lab's table
def _num(v: float) -> str:
    return "0" if v == 0 else f"{v:.1e}"


def format_results(results: List[Dict[str, object]], what: Optional[str] = None) -> str:
    """The per-rank numbers of ``launch/megatron_core_side_by_side.py`` as small tables in rank
    order (``results``: ``launcher.run(...).results``). ``what``: "column", "row",
    "mappings" or None (all that the job ran)."""
    if results and "skipped" in results[0]:
        return results[0]["skipped"]
    first = results[0]
    lines = [f"megatron-core {first['megatron_core']} vs mpu_lab, tp={first['tp']}: "
             f"max |mpu_lab - Megatron-core| per rank (0 = bit-identical)"]
    lines.append("same rank groups on every rank: " +
                 ("yes" if all(r["groups_equal"] for r in results) else "NO"))
    for kind in LINEAR_KINDS:
        if kind in first and what in (None, kind.replace("_sp", "")):
            sp = " + sequence parallel" if kind.endswith("_sp") else ""
            lines.append(f"\n{kind.replace('_sp', '')} parallel linear{sp}:")
            lines.append("rank  tp rank  same init  output   input grad  weight grad  bias grad")
            for r in results:
                c = r[kind]
                same = "yes" if c["same_init"] else "no"
                lines.append(f"{r['rank']:<6}{c['tp_rank']:<9}{same:<11}"
                             f"{_num(c['output']):<9}{_num(c['input_grad']):<12}"
                             f"{_num(c['weight_grad']):<13}{_num(c['bias_grad'])}")
    if "mappings" in first and what in (None, "mappings"):
        names = list(first["mappings"])
        lines.append("\nmappings, forward / backward:")
        lines.append("rank  " + "  ".join(f"{n:<{max(len(n), 15)}}" for n in names))
        for r in results:
            cells = [f"{_num(m['forward'])} / {_num(m['backward'])}"
                     for m in r["mappings"].values()]
            lines.append((f"{r['rank']:<6}" + "  ".join(
                f"{c:<{max(len(n), 15)}}" for n, c in zip(names, cells))).rstrip())
    return "\n".join(lines)
