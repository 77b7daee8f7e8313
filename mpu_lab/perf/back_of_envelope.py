"""Back-of-envelope scaling: the bytes each way of splitting a transformer moves against the FLOPs
it computes, and when the link, not the GPU, sets the pace.

The method of the JAX scaling book ("How to Scale Your Model", Austin et al. 2025, the chapters
on rooflines and on sharded matmuls) and of Stanford CS336's parallelism lecture: for each
parallel dimension write down, for one GPU and one span of work,

* the FLOPs it computes (forward + backward = 3 x forward, Narayanan et al. 2021 Appendix), and
* the bytes it must send over a link in that span (ring collectives: Patarasuk & Yuan 2009),

divide the first by the second: the **arithmetic intensity** of the communication, FLOPs per
byte sent. A link of bandwidth ``W`` bytes/s next to a GPU of peak ``F`` FLOP/s has a **ridge**
at ``F / W`` FLOPs per byte (the knee of the **roofline**: attainable FLOP/s =
``min(F, intensity x W)``, Williams et al. 2009). Above the ridge the work is **compute-bound**:
the transfer can hide behind the math. Below it the work is **communication-bound**: the GPU
waits for the link whatever is overlapped.

Each :class:`Traffic` below is linear in one quantity (its ``knob``): the hidden size for
tensor parallelism, the tokens per replica for data parallelism, ... so the knob value where
the intensity meets the ridge (:meth:`Traffic.critical`) says when the dimension turns
communication-bound. With ``B`` bytes per value (2 for bf16):

======  ==============================  ============================  ===========================
dim     FLOPs (one GPU)                 bytes sent (one GPU)          intensity
======  ==============================  ============================  ===========================
TP      3·T·(8h² + 4h·ffn)/t per layer  4·2(t−1)/t·T·h·B per layer    9h/((t−1)B) for ffn = 4h
DP      6·N·T per step                  2(d−1)/d·N·B per step         3T·d/((d−1)B)
PP      72·T·h²·(L/p)/t per stage       2·T·h·B/t per stage           36·h·(L/p)/B
CP      6·(s/c)²·b·h/t per ring step    6·(s/c)·b·h·B/t per step      (s/c)/B
EP      6·k·n·h·ffn·T per MoE layer     4·T·k·h·B·(e−1)/e per layer   1.5·n·ffn·e/((e−1)B)
======  ==============================  ============================  ===========================

T: tokens of one micro-batch on the GPU (s·b), N: parameters the GPU holds, n: weight matrices
per expert (3 gated, 2 plain). The bytes are those of :mod:`mpu_lab.perf.cost_model`
(:func:`~mpu_lab.perf.cost_model.tp_comm_per_layer`, ``dp_allreduce_bytes``,
``pipeline_p2p_bytes``, ``cp_comm_bytes_per_layer``, ``moe_a2a_bytes_per_layer``), which the
tests hold against these closed forms: two methods, one answer.

What it leaves out on purpose: latency (fine for large messages), the elementwise work, the
attention core of TP (``seq_length=`` adds it), imbalance, and whether the framework really
overlaps (Megatron 2021 does not overlap TP; there TP's time simply adds).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence, Tuple

from mpu_lab.perf.cost_model import DGX_H100, Cluster

__all__ = ["STRATEGIES", "Traffic", "ridge", "roofline", "matmul_intensity",
           "tensor_parallel", "data_parallel", "pipeline_parallel", "context_parallel",
           "expert_parallel", "links_of", "format_formulas", "format_strategies", "format_tp_sizes", "format_matmuls"]

STRATEGIES = ("tp", "dp", "pp", "cp", "ep")
COMPUTE_BOUND, COMM_BOUND = "compute-bound", "communication-bound"


def _positive(name: str, value, integer: bool = True):
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        what = "a positive integer" if integer else "a positive number"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


def ridge(peak_flops: float, bandwidth: float) -> float:
    """FLOPs per byte where the roofline bends: the GPU's ``peak_flops`` over the link's (or
    memory's) ``bandwidth`` in bytes/s. Work with a higher intensity is compute-bound."""
    _positive("peak_flops", peak_flops, integer=False)
    _positive("bandwidth", bandwidth, integer=False)
    return peak_flops / bandwidth


def roofline(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """Attainable FLOP/s at ``intensity`` FLOPs per byte: ``min(peak, intensity x bandwidth)``
    (Williams, Waterman & Patterson 2009)."""
    _positive("intensity", intensity, integer=False)
    return min(peak_flops, intensity * bandwidth)


def matmul_intensity(m: int, n: int, k: int, dtype_bytes: int = 2) -> float:
    """FLOPs per byte of memory traffic of one ``[m, k] @ [k, n]`` matmul that reads both
    inputs and writes the output once: ``2mnk / (B·(mk + kn + mn))``."""
    for name, value in (("m", m), ("n", n), ("k", k), ("dtype_bytes", dtype_bytes)):
        _positive(name, value)
    return 2 * m * n * k / (dtype_bytes * (m * k + k * n + m * n))


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What one GPU computes and sends in one span of work of one parallel dimension.

    ``knob`` names the quantity the intensity is proportional to and ``knob_value`` its value
    here, so :meth:`critical` can say at which value the dimension turns communication-bound.
    """
    strategy: str
    span: str
    flops: float
    bytes: float
    knob: str
    knob_value: float
    flops_formula: str
    bytes_formula: str
    intensity_formula: str
    setting: str = ""

    @property
    def intensity(self) -> float:
        """FLOPs per byte sent (infinite when nothing is sent: a group of one)."""
        return self.flops / self.bytes if self.bytes else float("inf")

    def compute_s(self, peak_flops: float) -> float:
        return self.flops / peak_flops

    def comm_s(self, bandwidth: float) -> float:
        return self.bytes / bandwidth

    def comm_share(self, peak_flops: float, bandwidth: float) -> float:
        """The share of the time spent communicating when nothing overlaps: ``r / (1 + r)``
        with ``r`` = transfer time over compute time = ridge / intensity."""
        r = self.comm_s(bandwidth) / self.compute_s(peak_flops)
        return r / (1 + r)

    def bound(self, peak_flops: float, bandwidth: float) -> str:
        """``"compute-bound"`` when the intensity reaches the ridge (the transfer could hide
        behind the math), else ``"communication-bound"``."""
        return COMPUTE_BOUND if self.intensity >= ridge(peak_flops, bandwidth) else COMM_BOUND

    def critical(self, peak_flops: float, bandwidth: float) -> float:
        """The ``knob`` value at which the intensity equals the ridge: below it the dimension
        is communication-bound. (The intensity is proportional to the knob.)"""
        if not self.bytes:
            return 0.0
        return self.knob_value * ridge(peak_flops, bandwidth) / self.intensity


def tensor_parallel(h: int, tokens: int, t: int, dtype_bytes: int = 2,
                    ffn: Optional[int] = None, seq_length: Optional[int] = None) -> Traffic:
    """One layer, one micro-batch of ``tokens`` (s·b), split ``t`` ways (Megatron's f and g,
    Narayanan et al. 2021 §3.2): the projections and the MLP, ``3·T·(8h² + 4h·ffn)/t`` FLOPs
    (plus the attention core ``12·T·s·h/t`` when ``seq_length`` is given), against four ring
    all-reduces of ``T·h`` values (two forward, two backward; with sequence parallelism the
    same bytes as all-gather + reduce-scatter). Intensity ``9h/((t−1)B)`` for ffn = 4h: the
    batch cancels, only the width helps."""
    for name, value in (("h", h), ("tokens", tokens), ("t", t), ("dtype_bytes", dtype_bytes)):
        _positive(name, value)
    ffn = 4 * h if ffn is None else _positive("ffn", ffn)
    core = 0 if seq_length is None else 4 * _positive("seq_length", seq_length) * h
    flops = 3 * tokens * (8 * h * h + 4 * h * ffn + core) / t
    sent = 4 * 2 * (t - 1) / t * tokens * h * dtype_bytes
    return Traffic("tp", "a layer, a micro-batch", flops, sent, "h", h,
                   "3·T·(8h² + 4h·ffn)/t", "8(t−1)/t · T·h·B", "9h / ((t−1)·B)",
                   f"t={t}, h={h}, T={tokens}")


def data_parallel(params: float, tokens: int, d: int, grad_bytes: int = 2) -> Traffic:
    """One step of a replica that holds ``params`` parameters per GPU and processes ``tokens``
    tokens per step (all its micro-batches): ``6·N·T`` FLOPs against one ring all-reduce of the
    gradients, ``2(d−1)/d·N·B`` bytes (the distributed optimizer's reduce-scatter + all-gather
    moves the same). Intensity ``3T·d/((d−1)B)``: the model size cancels, the tokens per
    replica decide."""
    _positive("params", params, integer=False)
    for name, value in (("tokens", tokens), ("d", d), ("grad_bytes", grad_bytes)):
        _positive(name, value)
    sent = 2 * (d - 1) / d * params * grad_bytes
    return Traffic("dp", "one step", 6 * params * tokens, sent, "tokens per replica", tokens,
                   "6·N·T", "2(d−1)/d · N·B", "3T·d / ((d−1)·B)",
                   f"d={d}, N={params:.3g}, T={tokens}")


def pipeline_parallel(h: int, tokens: int, layers: int, t: int = 1,
                      dtype_bytes: int = 2) -> Traffic:
    """One stage of ``layers`` layers (L/p), one micro-batch: ``72·T·h²·layers/t`` FLOPs against
    one activation sent on and one gradient sent back, ``2·T·h·B/t`` bytes (each of the t
    tensor-parallel ranks sends its 1/t, Narayanan et al. 2021 §4.1). Intensity
    ``36·h·(L/p)/B``: a stage's whole depth of compute per activation, so pipelining tolerates
    slow links; its cost is the bubble, not the bytes."""
    for name, value in (("h", h), ("tokens", tokens), ("layers", layers), ("t", t),
                        ("dtype_bytes", dtype_bytes)):
        _positive(name, value)
    return Traffic("pp", "a stage, a micro-batch", 72 * tokens * h * h * layers / t,
                   2 * tokens * h * dtype_bytes / t, "h·(L/p)", h * layers,
                   "72·T·h²·(L/p)/t", "2·T·h·B/t", "36·h·(L/p) / B",
                   f"L/p={layers}, h={h}, t={t}")


def context_parallel(h: int, seq_length: int, b: int, c: int, t: int = 1,
                     dtype_bytes: int = 2) -> Traffic:
    """One ring step of p2p context parallelism (ring attention, Liu et al. 2023), forward and
    backward, on one rank holding ``s/c`` tokens: the block pair's attention core,
    ``4·(s/c)²·b·h/t`` FLOPs forward of which the causal mask leaves half on average
    (Megatron's zig-zag layout evens it), times 3, against one K and V block forward and K, V,
    dK, dV backward, ``6·(s/c)·b·h·B/t`` bytes. Intensity ``(s/c)/B``: tokens per rank, whatever
    the width. Only the attention core hides the ring (TransformerEngine overlaps the ring
    with it); the layer's linear layers do not."""
    for name, value in (("h", h), ("seq_length", seq_length), ("b", b), ("c", c), ("t", t),
                        ("dtype_bytes", dtype_bytes)):
        _positive(name, value)
    if seq_length % c:
        raise ValueError(f"c = {c} must divide seq_length {seq_length}")
    chunk = seq_length // c
    sent = 6 * chunk * b * h * dtype_bytes / t if c > 1 else 0.0
    return Traffic("cp", "a ring step, fwd + bwd", 6 * chunk * chunk * b * h / t,
                   sent, "s/c (tokens per rank)", chunk,
                   "3 · ½ · 4·(s/c)²·b·h/t", "6·(s/c)·b·h·B/t", "(s/c) / B",
                   f"c={c}, s={seq_length}, t={t}")


def expert_parallel(h: int, tokens: int, ffn: int, k: int, e: int, gated: bool = True,
                    dtype_bytes: int = 2) -> Traffic:
    """One MoE layer, one micro-batch of ``tokens`` on this rank, experts split ``e`` ways: each
    token meets ``k`` experts of ``n`` = 3 (gated) or 2 ``h × ffn`` matrices, ``6·k·n·h·ffn·T``
    FLOPs, against the all-to-all dispatch and combine, forward and backward, ``4·T·k·h·B·(e−1)/e``
    bytes under balanced routing (GShard, Lepikhin et al. 2020). Intensity
    ``1.5·n·ffn·e/((e−1)B)``: the expert's width decides, not h or the batch."""
    for name, value in (("h", h), ("tokens", tokens), ("ffn", ffn), ("k", k), ("e", e),
                        ("dtype_bytes", dtype_bytes)):
        _positive(name, value)
    n = 3 if gated else 2
    sent = 4 * tokens * k * h * dtype_bytes * (e - 1) / e
    return Traffic("ep", "an MoE layer, a micro-batch", 6 * k * n * h * ffn * tokens, sent,
                   "ffn (expert width)", ffn, f"6·k·{n}·h·ffn·T", "4·T·k·h·B·(e−1)/e",
                   f"{1.5 * n:g}·ffn·e / ((e−1)·B)", f"e={e}, k={k}, ffn={ffn}")


def links_of(cluster: Cluster = DGX_H100) -> Dict[str, float]:
    """The two links of a cluster preset, bytes/s per GPU and direction: NVLink inside a node,
    the network (InfiniBand) between nodes."""
    return {"NVLink": cluster.intra_node_bandwidth, "InfiniBand": cluster.inter_node_bandwidth}


def format_formulas(cases: Sequence[Traffic]) -> str:
    """One row per case: the span of work it counts, its FLOPs, bytes and intensity as
    formulas (B: bytes per value)."""
    rows, seen = [], set()
    for c in cases:
        if c.strategy not in seen:
            seen.add(c.strategy)
            rows.append((c.strategy, c.span, c.flops_formula, c.bytes_formula,
                         c.intensity_formula))
    head = ("dim", "per", "FLOPs", "bytes sent", "FLOPs per byte")
    width = [max(len(r[i]) for r in rows + [head]) + 2 for i in range(4)]
    return "FLOPs and bytes of one GPU (B: bytes per value)\n" + "\n".join(
        "".join(f"{x:<{w}}" for x, w in zip(r, width)) + r[4] for r in [head] + rows)


def format_strategies(cases: Sequence[Traffic], cluster: Cluster = DGX_H100,
                      links: Optional[Dict[str, float]] = None,
                      peak_flops: Optional[float] = None, name: Optional[str] = None,
                      per: str = "GPU") -> str:
    """One row per case: its intensity, and for each link (default: ``cluster``'s NVLink and
    InfiniBand, :func:`links_of`; or ``links``, name -> bytes/s) next to ``peak_flops``
    (default: the cluster's datasheet peak, no efficiency) the verdict (compute- or
    communication-bound) and the knob value below which it turns communication-bound; each
    dimension's knob is named on the last line. ``per``: what the peak is of ("GPU", "rank")."""
    links = links_of(cluster) if links is None else dict(links)
    peak = cluster.peak_flops if peak_flops is None else peak_flops
    ridges = ", ".join(f"{link} {ridge(peak, bw):,.0f}" for link, bw in links.items())
    wide = max([len("setting")] + [len(c.setting) for c in cases]) + 2
    lines = [f"{name or cluster.name}: {peak / 1e12:,.3g} TFLOP/s per {per}; ridge F/W in FLOPs "
             f"per byte: {ridges}",
             f"{'':<{5 + wide + 10}}" + "".join(f" | {'on ' + link:<23}" for link in links),
             f"{'dim':<5}{'setting':<{wide}}{'FLOP/B':>10}"
             + "".join(f" | {'bound':<14}{'knob >=':>9}" for _ in links)]
    knobs = {}
    for c in cases:
        row = f"{c.strategy:<5}{c.setting:<{wide}}{c.intensity:>10,.0f}"
        for bw in links.values():
            row += f" | {c.bound(peak, bw).replace('-bound', ''):<14}{c.critical(peak, bw):>9,.0f}"
        lines.append(row.rstrip())
        knobs.setdefault(c.strategy, c.knob)
    lines.append("knob: " + "; ".join(f"{dim} {knob}" for dim, knob in knobs.items()))
    return "\n".join(line.rstrip() for line in lines)


def format_tp_sizes(h: int, tokens: int, sizes: Sequence[int], cluster: Cluster = DGX_H100,
                    dtype_bytes: int = 2) -> str:
    """Tensor parallelism of width ``h`` at each size t in ``sizes``: its intensity, and the share
    of the time its all-reduces take when nothing overlaps, on NVLink (only while t fits in a
    node of ``cluster``) and on the network (datasheet rates)."""
    peak, links = cluster.peak_flops, links_of(cluster)
    lines = [f"h = {h:,}: TP all-reduces, share of the time if not overlapped "
             f"({cluster.name}, {cluster.gpus_per_node} GPUs per node)",
             f"{'t':>4}{'FLOP/B':>9}{'NVLink':>12}{'InfiniBand':>12}"]
    for t in sizes:
        tp = tensor_parallel(h, tokens, t, dtype_bytes)
        inside = (f"{tp.comm_share(peak, links['NVLink']):.0%}" if t <= cluster.gpus_per_node
                  else "(> node)")
        lines.append(f"{t:>4}{tp.intensity:>9,.0f}{inside:>12}"
                     f"{tp.comm_share(peak, links['InfiniBand']):>12.0%}")
    return "\n".join(lines)


def format_matmuls(shapes: Sequence[Tuple[int, int, int]], peak_flops: float,
                   bandwidth: float, dtype_bytes: int = 2, label: str = "HBM") -> str:
    """The roofline of single matmuls ``(m, n, k)`` on one GPU: intensity against the memory
    ridge, attainable TFLOP/s, and the verdict."""
    r = ridge(peak_flops, bandwidth)
    lines = [f"ridge = peak / {label} bandwidth = {peak_flops / 1e12:,.0f} TFLOP/s / "
             f"{bandwidth / 1e12:.2f} TB/s = {r:,.0f} FLOPs per byte",
             f"{'m x n x k':<22}{'FLOP/B':>9}{'attainable TFLOP/s':>20}  verdict"]
    for m, n, k in shapes:
        i = matmul_intensity(m, n, k, dtype_bytes)
        verdict = "compute-bound" if i >= r else "memory-bound"
        lines.append(f"{f'{m} x {n} x {k}':<22}{i:>9,.0f}"
                     f"{roofline(i, peak_flops, bandwidth) / 1e12:>20,.0f}  {verdict}")
    return "\n".join(lines)
