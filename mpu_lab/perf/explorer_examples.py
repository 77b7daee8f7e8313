"""Two worked examples of the explorer's ranking with the newer dimensions (re-exported by
:mod:`mpu_lab.perf.explorer`): :func:`long_sequence_example` ranks (t, p, d, cp) for GPT-3 175B
at a 32k sequence, where context parallelism is what makes it fit, and :func:`moe_example`
(t, p, d, ep) for Mixtral 8x7B (:mod:`mpu_lab.perf.cost_model.context`,
:mod:`mpu_lab.perf.cost_model.moe`)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from mpu_lab.perf.printing import fit
from mpu_lab.perf.cost_model import (DGX_H100, GPT3_175B, MIXTRAL_8X7B, Cluster,
                                     rank_context_parallel, rank_expert_parallel)

__all__ = ["long_sequence_example", "moe_example"]


def _scaling_table(title: str, rows, key: str, top: int) -> str:
    head = f"{'#':>3}{'t':>4}{'p':>4}{'d':>5}{key:>4}{'time s':>9}{'mem GB':>8}  fits"
    lines = [fit(title), head, "-" * len(head)]
    for i, r in enumerate(rows[:top]):
        c = r.config
        lines.append(f"{i + 1:>3}{c.tp:>4}{c.pp:>4}{c.dp:>5}{getattr(r, key):>4}"
                     f"{r.total_s:>9.3f}{r.memory_gb:>8.1f}  {'yes' if r.fits else 'no'}")
    return "\n".join(lines)


def long_sequence_example(num_gpus: int = 512, global_batch_size: int = 64,
                          seq_length: int = 32768, cps: Sequence[int] = (1, 2, 4, 8),
                          cluster: Optional[Cluster] = None, top: int = 10) -> dict:
    """GPT-3 175B at a 32k sequence on DGX H100s, where context parallelism is what makes it
    fit: every (t, p, d, cp) ranked by :func:`~mpu_lab.perf.cost_model.rank_context_parallel`
    (selective recomputation, SP, the distributed optimizer, t inside a node, p2p ring).
    Table 2's activations (Korthikanti et al. 2022) of one micro-batch stage, ``34·s·b·h·L/t``
    bytes over the in-flight micro-batches, are 164 GB at t = 8 whatever p is; cp divides
    them. Returns ``model``, ``ranking`` (fitting first, then by time), ``verdict``
    (cp → "fits" / "does not fit": whether some (t, p, d) with that cp fits) and ``table``."""
    model = dataclasses.replace(GPT3_175B, seq_length=seq_length,
                                name=f"GPT-3 175B at s = {seq_length:,}")
    cluster = cluster or DGX_H100
    ranked = rank_context_parallel(model, cluster, num_gpus, global_batch_size, cps)
    verdict = {cp: "fits" if any(r.fits and r.cp == cp for r in ranked) else "does not fit"
               for cp in cps}
    title = (f"{model.name} on {num_gpus} GPUs ({cluster.name}), batch {global_batch_size}; "
             + ", ".join(f"cp={cp}: {v}" for cp, v in verdict.items()))
    return dict(model=model, ranking=ranked, verdict=verdict,
                table=_scaling_table(title, ranked, "cp", top))


def moe_example(num_gpus: int = 64, global_batch_size: int = 256,
                cluster: Optional[Cluster] = None, top: int = 10) -> dict:
    """Mixtral 8x7B (Jiang et al. 2024) on DGX H100s: every (t, p, d, ep) ranked by
    :func:`~mpu_lab.perf.cost_model.rank_expert_parallel` (selective recomputation, SP, the
    distributed optimizer, t inside a node). Returns ``model``, ``ranking``, ``table``."""
    cluster = cluster or DGX_H100
    ranked = rank_expert_parallel(MIXTRAL_8X7B, cluster, num_gpus, global_batch_size)
    title = (f"{MIXTRAL_8X7B.name} on {num_gpus} GPUs ({cluster.name}), batch "
             f"{global_batch_size} of {MIXTRAL_8X7B.s} tokens")
    return dict(model=MIXTRAL_8X7B, ranking=ranked, table=_scaling_table(title, ranked, "ep", top))
