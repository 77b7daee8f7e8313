"""Lab 02's lessons on what collectives cost: who sends how many bytes in a ring all-reduce, the
alpha-beta model fitted to this machine against the published links, and its picture.

* :func:`format_ring_traffic` — bytes per rank of a ring all-reduce against one rank that
  gathers, sums and broadcasts, for several group sizes (the prediction's reveal);
* :func:`format_bus_factors` — nccl-tests' busbw / algbw per collective for a group size;
* :func:`timing_ranks` — how many ranks a timing on this machine should use;
* :func:`link_models` / :func:`format_link_models` — this machine's fitted alpha-beta line
  next to a DGX's NVLink and InfiniBand (the cost model's presets), with the size where the
  bandwidth term overtakes the latency;
* :func:`plot_alpha_beta` — the measured times, the fitted line and its two asymptotes.

Formulas: :mod:`mpu_lab.perf.bandwidth` (bus factors, ring steps, the fit); hardware figures:
:mod:`mpu_lab.perf.cost_model.inputs` (datasheets). Nothing here is timed.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

import torch

from mpu_lab.labkit.style import new_figure, styled
from mpu_lab.perf import bandwidth
from mpu_lab.perf.cost_model.inputs import Cluster

MIB = 1024 ** 2


def _human(nbytes: float) -> str:
    for unit, scale in (("GiB", 1024 ** 3), ("MiB", MIB), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.3g} B"


def format_ring_traffic(n: int, size_bytes: float, sizes: Sequence[int] = (2, 4, 8, 64, 1024)
                        ) -> str:
    """What each rank sends to all-reduce ``size_bytes``: the ring (every rank ``2 (n-1)/n`` of
    the array) against a root that receives every array, sums and sends the sum back (the root
    sends ``(n-1)`` arrays, the others one), for the group sizes ``sizes`` and ``n``."""
    rows = sorted(set(sizes) | {n})
    lines = [f"all-reduce of {_human(size_bytes)}: bytes each rank sends",
             f"{'ranks n':>8} {'ring, every rank':>18} {'the root of reduce + broadcast':>32}"]
    for k in rows:
        ring = bandwidth.bus_factor("all_reduce", k) * size_bytes
        root = (k - 1) * size_bytes
        mark = "   <- this world" if k == n else ""
        lines.append(f"{k:>8} {_human(ring):>18} {_human(root):>32}{mark}")
    return "\n".join(lines)


def format_bus_factors(n: int) -> str:
    """busbw = algbw x factor for each collective of :data:`mpu_lab.perf.bandwidth.COLLECTIVES`
    at ``n`` ranks, with the ring steps (messages one after another) of each."""
    lines = [f"{n} ranks: {'collective':>15} {'busbw / algbw':>14} {'ring steps':>11}"]
    for op in bandwidth.COLLECTIVES:
        lines.append(f"{'':>9}{op:>15} {bandwidth.bus_factor(op, n):>14.3f} "
                     f"{bandwidth.ring_steps(op, n):>11}")
    return "\n".join(lines)


def timing_ranks(world_size: int, cores: Optional[int] = None,
                 gpus: Optional[int] = None) -> int:
    """Ranks for a timing on this machine: ``world_size`` when every rank has a GPU of its own;
    else at most one rank per CPU core, since a rank that waits for a peer hands its core to
    another, and time would be measured for the sharing rather than for the links."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if gpus >= world_size:
        return world_size
    return max(1, min(world_size, cores))


def link_models(fit: Dict, clusters: Sequence[Cluster], n: int) -> List[Dict]:
    """The all-reduce over ``n`` ranks on this machine (:func:`mpu_lab.perf.bandwidth.fit_alpha_beta`'s
    fit: its alpha per ring step times the ``2 (n-1)`` steps of ``n`` ranks, its busbw) and on
    each cluster's NVLink and network link as the cost model sees them (one ``latency_s`` per
    collective, the link's bandwidth x its achievable share). Each row: ``name``,
    ``latency_s``, ``busbw`` (bytes/s) and ``crossover_bytes``, the array size S at which the
    bandwidth term ``2 (n-1)/n x S / busbw`` equals the latency (below it, latency rules)."""
    factor = bandwidth.bus_factor("all_reduce", n)
    rows = [dict(name=f"this machine (fitted on {fit['nproc']} ranks)",
                 latency_s=fit["alpha_s"] * bandwidth.ring_steps("all_reduce", n),
                 busbw=fit["busbw"])]
    for c in clusters:
        for link, bw in (("NVLink", c.intra_node_bandwidth), ("InfiniBand", c.inter_node_bandwidth)):
            rows.append(dict(name=f"{c.name} {link}", latency_s=c.latency_s,
                             busbw=bw * c.bandwidth_efficiency))
    for r in rows:
        r["crossover_bytes"] = r["latency_s"] * r["busbw"] / factor if factor else float("inf")
    return rows


def all_reduce_seconds(row: Dict, size_bytes: float, n: int) -> float:
    """A :func:`link_models` row's all-reduce time for ``size_bytes`` over ``n`` ranks."""
    return row["latency_s"] + bandwidth.bus_factor("all_reduce", n) * size_bytes / row["busbw"]


def format_link_models(rows: Sequence[Dict], n: int, sizes: Sequence[float]) -> str:
    """:func:`link_models` as a table: latency, bus bandwidth, the crossover size, and the
    predicted all-reduce time of each size in ``sizes`` over ``n`` ranks."""
    head = (f"{'link':<32} {'latency':>9} {'busbw GB/s':>11} {'crossover':>10} "
            + " ".join(f"{'t(' + _human(s) + ')':>10}" for s in sizes))
    lines = [f"all-reduce over n = {n} ranks: t = latency + (bytes each rank sends) / busbw", head]
    for r in rows:
        times = " ".join(f"{_seconds(all_reduce_seconds(r, s, n)):>10}" for s in sizes)
        lines.append(f"{r['name']:<32} {_seconds(r['latency_s']):>9} {r['busbw'] / 1e9:>11.3g} "
                     f"{_human(r['crossover_bytes']):>10} {times}")
    return "\n".join(lines)


def _seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


@styled
def plot_alpha_beta(fit: Dict, title: str = ""):
    """Measured all-reduce time against the array size (log-log), the fitted
    ``latency + 2(n-1)/n x S / busbw`` line, and its two asymptotes: the latency alone (flat)
    and the bandwidth term alone (slope 1)."""
    fig = new_figure(7.0, 3.4)
    ax = fig.add_subplot()
    sizes = [s for s, _, _ in fit["rows"]]
    ax.plot(sizes, [t * 1e3 for _, t, _ in fit["rows"]], "o", color="#1f77b4", label="measured")
    lo, hi = sizes[0] / 2, sizes[-1] * 2
    grid = [lo * (hi / lo) ** (i / 60) for i in range(61)]
    factor = bandwidth.bus_factor("all_reduce", fit["nproc"])
    ax.plot(grid, [(fit["latency_s"] + factor * s / fit["busbw"]) * 1e3 for s in grid],
            color="#d62728", label="alpha-beta fit")
    ax.plot(grid, [fit["latency_s"] * 1e3] * len(grid), ":", color="grey",
            label="latency alone")
    ax.plot(grid, [factor * s / fit["busbw"] * 1e3 for s in grid], "--", color="grey",
            label="bandwidth alone")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylim(bottom=min(t for _, t, _ in fit["rows"]) * 1e3 / 5)
    ax.set_xlabel("array size S (bytes)")
    ax.set_ylabel("all-reduce time (ms)")
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(title, loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig
