"""The overlap model of bucketed data parallelism: when each bucket's all-reduce can start,
when it ends, and what the step pays after backward (pure arithmetic, no process).

Backward produces the gradients last layer first at an even rate in bytes, so bucket ``i``
(the buffer is filled in reverse order, :mod:`mpu_lab.core.distributed.param_and_grad_buffer`) is
ready once backward has produced the bytes of buckets ``0..i``. The reductions run one after
another on one communication channel (NCCL's stream; gloo's thread), each taking the
alpha-beta time of a ring all-reduce of its bytes
(:func:`mpu_lab.perf.bandwidth.alpha_beta_seconds`). Without overlap every bucket starts at
backward's end. **Exposed** communication is what the last reduction runs past backward's end::

    bucket i starts at max(ready_i, end_{i-1});  exposed = max(0, end_last - backward)

The model assumes the channel does not slow backward down: true on a GPU (NCCL's kernels and
NVLink / the NIC beside the compute kernels), not on a CPU rank with one core, where gloo's
copies and sums run on the very core that computes backward.

Two sizes of bucket lose: tiny ones pay the latency ``alpha`` once per bucket, and one bucket
for everything cannot start before backward ends. :func:`sweep` shows both;
:func:`predict_dgx_h100` gives the numbers for GPT-3 XL (1.3 B) on one DGX H100.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

from mpu_lab.perf.bandwidth import alpha_beta_seconds
from mpu_lab.perf.cost_model import DGX_H100, Cluster, ModelShape
from mpu_lab.perf.cost_model.counts import flops_per_token, parameter_count

# Megatron-core's default --ddp-bucket-size: max(40,000,000, 1,000,000 x d) elements
MEGATRON_BUCKET_NUMEL = 40_000_000
GPT3_XL = ModelShape(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                     vocab_size=51200, name="GPT-3 XL (1.3 B)")


@dataclasses.dataclass(frozen=True)
class StepTimeline:
    """One step as the model sees it: backward's length, each bucket's ``(ready, start,
    end)`` in seconds from backward's start, and the exposed communication."""
    backward_s: float
    bucket_bytes: List[float]
    ready_s: List[float]
    start_s: List[float]
    end_s: List[float]
    overlap: bool
    label: str = ""

    @property
    def exposed_s(self) -> float:
        return max(0.0, (self.end_s[-1] if self.end_s else 0.0) - self.backward_s)

    @property
    def step_s(self) -> float:
        """Backward plus what the reductions add after it (forward and the optimizer are the
        same with and without overlap, so they are left out)."""
        return self.backward_s + self.exposed_s

    @property
    def comm_s(self) -> float:
        return sum(e - s for s, e in zip(self.start_s, self.end_s))


def bucket_timeline(bucket_bytes: Sequence[float], backward_s: float, d: int, alpha_s: float,
                    busbw: float, overlap: bool, label: str = "") -> StepTimeline:
    """The model above for buckets of ``bucket_bytes`` (first reduced first) over ``d`` ranks,
    a backward of ``backward_s`` seconds, ``alpha_s`` per ring step and a bus bandwidth of
    ``busbw`` bytes/s."""
    if not bucket_bytes or min(bucket_bytes) <= 0:
        raise ValueError(f"bucket_bytes must be a non-empty list of sizes > 0, got "
                         f"{list(bucket_bytes)}")
    if backward_s < 0 or d < 2:
        raise ValueError(f"need backward_s >= 0 and d >= 2 ranks, got {backward_s}, {d}")
    total, done, free = float(sum(bucket_bytes)), 0.0, 0.0
    ready, start, end = [], [], []
    for size in bucket_bytes:
        done += size
        ready.append(backward_s * done / total if overlap else backward_s)
        start.append(max(ready[-1], free))
        free = start[-1] + alpha_beta_seconds("all_reduce", size, d, alpha_s, busbw)
        end.append(free)
    return StepTimeline(backward_s, [float(b) for b in bucket_bytes], ready, start, end,
                        overlap, label)


def cut_into_buckets(numel: int, bucket_numel: int, bytes_per_element: int = 4) -> List[float]:
    """The buffer of ``numel`` gradients cut every ``bucket_numel`` elements (the last bucket
    takes the rest), in bytes: Megatron's cut, with parameters small against a bucket."""
    if numel < 1 or bucket_numel < 1:
        raise ValueError(f"numel and bucket_numel must be >= 1, got {numel}, {bucket_numel}")
    full, rest = divmod(numel, bucket_numel)
    return [float(bucket_numel * bytes_per_element)] * full + \
        ([float(rest * bytes_per_element)] if rest else [])


def backward_seconds(model: ModelShape, tokens: int, cluster: Cluster) -> float:
    """Backward's matmuls (twice the forward's FLOPs, Narayanan et al. 2021 §5.1) for
    ``tokens`` tokens on one GPU at the cluster's achieved matmul rate."""
    per_token = flops_per_token(model)
    forward = tokens * (model.num_layers * per_token["layer"] + per_token["logits"])
    return 2 * forward / (cluster.peak_flops * cluster.matmul_efficiency)


def predict_dgx_h100(model: ModelShape = GPT3_XL, d: int = 8, micro_batch_size: int = 4,
                     bucket_numel: int = MEGATRON_BUCKET_NUMEL, cluster: Cluster = DGX_H100,
                     ) -> Dict[bool, StepTimeline]:
    """``{overlap: StepTimeline}`` predicted for ``model`` at DP = ``d`` inside one node
    (NVLink), one micro-batch of ``micro_batch_size`` sequences per GPU, fp32 gradients
    (Megatron reduces bf16 training's gradients in fp32) in buckets of ``bucket_numel``."""
    if d > cluster.gpus_per_node:
        raise ValueError(f"d = {d} does not fit in one {cluster.name} node of "
                         f"{cluster.gpus_per_node} GPUs")
    backward = backward_seconds(model, micro_batch_size * model.seq_length, cluster)
    buckets = cut_into_buckets(parameter_count(model), bucket_numel)
    busbw = cluster.intra_node_bandwidth * cluster.bandwidth_efficiency
    label = (f"predicted: {model.name}, d = {d} on one {cluster.name} (NVLink), "
             f"{len(buckets)} buckets of {bucket_numel / 1e6:g} M fp32 gradients")
    return {flag: bucket_timeline(buckets, backward, d, cluster.latency_s, busbw, flag, label)
            for flag in (False, True)}


def sweep(bucket_numels: Sequence[int], numel: int, backward_s: float, d: int, alpha_s: float,
          busbw: float, bytes_per_element: int = 4) -> List[Dict[str, float]]:
    """Per bucket size: buckets, exposed communication without and with overlap (s)."""
    rows = []
    for size in bucket_numels:
        buckets = cut_into_buckets(numel, size, bytes_per_element)
        off, on = (bucket_timeline(buckets, backward_s, d, alpha_s, busbw, flag)
                   for flag in (False, True))
        rows.append(dict(bucket_numel=size, buckets=len(buckets), exposed_off_s=off.exposed_s,
                         exposed_on_s=on.exposed_s))
    return rows


def predict_dgx_h100_sweep(bucket_numels: Sequence[int], model: ModelShape = GPT3_XL,
                           d: int = 8, micro_batch_size: int = 4,
                           cluster: Cluster = DGX_H100) -> List[Dict[str, float]]:
    """:func:`sweep` for :func:`predict_dgx_h100`'s step (NVLink inside one node)."""
    backward = backward_seconds(model, micro_batch_size * model.seq_length, cluster)
    return sweep(bucket_numels, parameter_count(model), backward, d, cluster.latency_s,
                 cluster.intra_node_bandwidth * cluster.bandwidth_efficiency)


def format_prediction(timelines: Dict[bool, StepTimeline]) -> str:
    """A table: backward, the reductions, the exposed part and the step (ms), without and with
    overlap, then the share overlap saves."""
    off, on = timelines[False], timelines[True]
    lines = [on.label, f"  {'ms':<16} {'backward':>8} {'all-reduces':>11} {'exposed':>7}  "
                       f"step (backward + exposed)"]
    for name, t in (("without overlap", off), ("with overlap", on)):
        lines.append(f"  {name:<16} {1e3 * t.backward_s:8.1f} {1e3 * t.comm_s:11.1f} "
                     f"{1e3 * t.exposed_s:7.1f}  {1e3 * t.step_s:.1f}")
    lines.append(f"  overlap saves {100 * (1 - on.step_s / off.step_s):.0f} % of it")
    return "\n".join(lines)


def format_sweep(rows: Sequence[Dict[str, float]], title: str) -> str:
    lines = [title, f"{'bucket (elements)':>18} {'buckets':>8} {'exposed, no overlap':>20} "
                    f"{'exposed, overlap':>17}"]
    lines += [f"{r['bucket_numel']:>18,} {r['buckets']:>8} {1e3 * r['exposed_off_s']:>17.1f} ms"
              f" {1e3 * r['exposed_on_s']:>14.1f} ms" for r in rows]
    return "\n".join(lines)


def fit_channel(measured: Sequence[Dict[str, float]], d: int) -> Dict[str, float]:
    """``alpha_s`` and ``busbw`` of a machine's channel, fitted to measured steps without
    overlap, where the exposed communication is every reduction one after another:
    ``exposed = buckets x 2 (d-1) alpha + 2 (d-1)/d x bytes / busbw``. A sweep of bucket
    sizes moves the same bytes at every size, so the fit is a straight line in the number of
    buckets (least squares): its slope is the latency per bucket, its intercept the transfer
    time of the bytes (``busbw`` is infinite where the intercept is not positive: the
    transfer did not show). Each row: ``buckets``, ``bytes`` (the whole buffer),
    ``exposed_off_s``; two bucket counts at least."""
    if len({r["buckets"] for r in measured}) < 2:
        raise ValueError("need measurements at two bucket counts or more to fit a channel")
    n = len(measured)
    ks = [float(r["buckets"]) for r in measured]
    ts = [float(r["exposed_off_s"]) for r in measured]
    k_mean, t_mean = sum(ks) / n, sum(ts) / n
    slope = sum((k - k_mean) * (t - t_mean) for k, t in zip(ks, ts)) / \
        sum((k - k_mean) ** 2 for k in ks)
    slope = max(slope, 0.0)
    intercept = t_mean - slope * k_mean
    transfer = 2 * (d - 1) / d * sum(r["bytes"] for r in measured) / n
    return dict(alpha_s=slope / (2 * (d - 1)),
                busbw=transfer / intercept if intercept > 0 else float("inf"))
