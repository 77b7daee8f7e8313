"""The cost model's time prediction: one training iteration by cause, throughput, MFU, memory.

:func:`predict_iteration` turns a :class:`~mpu_lab.perf.cost_model.inputs.ModelShape`, a
:class:`~mpu_lab.perf.cost_model.inputs.ParallelConfig` and a
:class:`~mpu_lab.perf.cost_model.inputs.Cluster` into an :class:`IterationPrediction`: seconds
per iteration by cause (compute, tensor-parallel communication, pipeline p2p, bubble,
data-parallel communication, optimizer step), TFLOP/s per GPU, MFU (Korthikanti et al. 2022
§6) and memory per GPU. :data:`EFFECTS` can be left out one by one (what-if studies).

Modelling assumptions (plain):

* Matmuls run at ``peak_flops * matmul_efficiency`` — one constant per GPU generation.
* Everything that is not a matmul (layer norm, GeLU, softmax, dropout, residual adds) is
  memory-bound: each byte of the activations Korthikanti et al. count is written once in the
  forward pass, read once in the backward pass, and its gradient written and read once
  (:data:`ELEMENTWISE_PASSES` = 4), plus one more write when the forward is recomputed.
* Collectives run at ``bandwidth * bandwidth_efficiency`` of the slowest link they cross plus
  ``latency_s``; a group that fits in one node uses NVLink, else the per-GPU network port.
  Megatron's rank order (t fastest, then d, then p) decides which groups cross nodes.
* Tensor-parallel collectives sit on the critical path (Megatron 2021 does not overlap them)
  unless ``overlap_tp_comm``. Pipeline send/recv is on the critical path. The data-parallel
  gradient all-reduce runs after the pipeline flush, or, with ``overlap_grad_reduce``, hides
  behind the last micro-batch's backward pass and only the excess shows.
* Pipeline: all stages hold L/p layers; the last stage also computes the logits, and the
  slowest stage sets the pace. 1F1B's bubble is (p-1) micro-batch times of that stage, the
  interleaved schedule's (p-1)/v (Narayanan et al. 2021 §2.2).
* Host work that does not scale with the model's width (Python, the autograd engine, op
  dispatch, the small collectives of the gradient norm, the loss log and the TP data
  broadcast) is one measured figure, ``host_overhead_s`` (:attr:`IterationPrediction.framework_s`;
  0 unless given). On a GPU the host runs ahead of the device and hides it; on a CPU it adds
  to the step: :func:`mpu_lab.perf.calibrate.host_overhead` measures it as what a real step
  takes at a tiny width, where the other terms vanish.
* Recomputation (Korthikanti et al. 2022 §5) costs its extra forward FLOPs (the attention
  core for selective; every layer, or Megatron's block method's first N layers of each chunk,
  for full), one more elementwise write, and with full recomputation the forward's
  tensor-parallel collectives again; :func:`pick_recompute` finds, for one split, the fastest
  mode that fits.
* Not modelled: host overhead unless given as host_overhead_s, data loading, imbalance
  other than the logits, network contention between groups, stragglers.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Sequence

from mpu_lab.perf.cost_model.counts import (
    dp_allreduce_bytes, flops_per_token, hardware_flops_per_iteration, layer_activation_bytes,
    memory_per_gpu, model_flops_per_iteration, parameters_per_gpu, pipeline_p2p_bytes,
    recomputed_share, ring_all_reduce_factor, score_bytes, tp_comm_per_layer)
from mpu_lab.perf.cost_model.inputs import Cluster, ModelShape, ParallelConfig

__all__ = ["ELEMENTWISE_PASSES", "ADAM_STEP_BYTES_PER_PARAM", "IterationPrediction",
           "group_crosses_nodes", "EFFECTS", "predict_iteration", "recompute_label",
           "pick_recompute"]

ELEMENTWISE_PASSES = 4           # forward write, backward read, gradient write + read
ADAM_STEP_BYTES_PER_PARAM = 28   # reads fp32 param, m, v + 16-bit grad (14 B), writes them back


@dataclasses.dataclass(frozen=True)
class IterationPrediction:
    """What :func:`predict_iteration` returns: seconds per iteration by cause, throughput, memory.

    ``compute_s`` (matmuls + memory-bound ops, all m micro-batches of the slowest stage),
    ``tp_comm_s``, ``pp_p2p_s`` and ``bubble_s`` are on the critical path as described in the
    module docstring; ``dp_comm_s`` is the exposed part of the gradient all-reduce;
    ``optimizer_s`` the Adam step; ``framework_s`` the host overhead the prediction was given
    (``host_overhead_s``, 0 by default). ``total_s`` is their sum.
    """
    model: ModelShape
    config: ParallelConfig
    cluster: Cluster
    compute_s: float
    matmul_s: float
    elementwise_s: float
    tp_comm_s: float
    pp_p2p_s: float
    bubble_s: float
    dp_comm_s: float
    optimizer_s: float
    total_s: float
    model_flops: float
    hardware_flops: float
    memory: Dict[str, float]
    framework_s: float = 0.0

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.model_flops / self.total_s / self.config.num_gpus / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        """TFLOP/s per GPU counting recomputation — what Narayanan et al. 2021 report."""
        return self.hardware_flops / self.total_s / self.config.num_gpus / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation (Korthikanti et al. 2022 §6): model FLOP/s / peak."""
        return self.model_tflops_per_gpu * 1e12 / self.cluster.peak_flops

    @property
    def hfu(self) -> float:
        return self.hardware_tflops_per_gpu * 1e12 / self.cluster.peak_flops

    @property
    def memory_gb(self) -> float:
        return self.memory["total"] / 1e9

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.cluster.memory_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.config.global_batch_size * self.model.s / self.total_s

    def breakdown(self) -> Dict[str, float]:
        """Seconds per iteration by cause, in a fixed order (for tables and stacked bars);
        ``framework`` only where the prediction was given a host overhead."""
        out = {"compute": self.compute_s, "tp_comm": self.tp_comm_s, "pp_p2p": self.pp_p2p_s,
               "bubble": self.bubble_s, "dp_comm": self.dp_comm_s,
               "optimizer": self.optimizer_s}
        if self.framework_s:
            out["framework"] = self.framework_s
        return out

    def shares(self) -> Dict[str, float]:
        return {k: v / self.total_s for k, v in self.breakdown().items()}

    def summary(self) -> str:
        """A few rounded lines: time by cause, throughput, memory (deterministic)."""
        c = self.config
        lines = [f"{self.model.name or 'model'} on {c.num_gpus} GPUs ({self.cluster.name}): "
                 f"t={c.tp} p={c.pp} d={c.dp} v={c.v} b={c.b} m={c.m}, recompute {c.recompute}"
                 + (f" (block: first {c.recompute_num_layers} layers of each chunk)"
                    if c.recompute_num_layers else "")
                 + (", SP" if c.sequence_parallel else "")]
        for key, secs in self.breakdown().items():
            lines.append(f"  {key:<10}{secs:>10.4f} s  {secs / self.total_s:>6.1%}")
        lines.append(f"  {'total':<10}{self.total_s:>10.4f} s")
        lines.append(f"  {self.hardware_tflops_per_gpu:.1f} TFLOP/s per GPU with recomputation, "
                     f"MFU {self.mfu:.1%}; {self.memory_gb:.1f} GB per GPU "
                     f"({'fits' if self.fits else 'does NOT fit'} in "
                     f"{self.cluster.memory_bytes / 1e9:.0f} GB)")
        return "\n".join(lines)

    def as_dict(self, digits: int = 4) -> Dict[str, float]:
        """Rounded, JSON-able summary (deterministic for notebooks)."""
        out = {k + "_s": round(v, digits) for k, v in self.breakdown().items()}
        out.update(total_s=round(self.total_s, digits),
                   tflops_per_gpu=round(self.hardware_tflops_per_gpu, 1),
                   model_tflops_per_gpu=round(self.model_tflops_per_gpu, 1),
                   mfu=round(self.mfu, 3), memory_gb=round(self.memory_gb, 1), fits=self.fits)
        return out


def _bandwidth(cluster: Cluster, crosses_nodes: bool) -> float:
    link = cluster.inter_node_bandwidth if crosses_nodes else cluster.intra_node_bandwidth
    return link * cluster.bandwidth_efficiency


def _collective_time(cluster: Cluster, nbytes: float, crosses_nodes: bool, count: int = 1
                     ) -> float:
    if count == 0:
        return 0.0
    return count * cluster.latency_s + nbytes / _bandwidth(cluster, crosses_nodes)


def group_crosses_nodes(group: str, cfg: ParallelConfig, gpus_per_node: int) -> bool:
    """Whether the ``"tp"``, ``"dp"`` or ``"pp"`` group spans nodes under Megatron's rank order
    (t fastest, then d, then p): TP ranks are consecutive; DP ranks step by t; pipeline
    neighbours step by t·d."""
    span = {"tp": cfg.tp, "dp": cfg.tp * cfg.dp, "pp": cfg.tp * cfg.dp * cfg.pp}[group]
    size = {"tp": cfg.tp, "dp": cfg.dp, "pp": cfg.pp}[group]
    return size > 1 and span > gpus_per_node


def _dp_exposed_time(model: ModelShape, cfg: ParallelConfig, cluster: Cluster,
                     grad_bytes: int, backward_mb: float) -> float:
    """Seconds of data-parallel communication on the critical path.

    Without overlap: the whole gradient all-reduce after the pipeline flush. With
    ``overlap_grad_reduce``: a stage's gradients are final only in its last micro-batch's
    backward pass, so the reduction of each of the v model chunks may start when that chunk's
    last backward starts; in the interleaved schedule the v chunks finish p chunk-steps apart
    (Narayanan et al. 2021 Fig. 4), giving the earlier chunks a head start. The chunks queue on
    the link; what runs past the end of the backward pass is exposed. With the distributed
    optimizer the all-reduce is a reduce-scatter (overlapped as above) plus a parameter
    all-gather that hides the same way behind the next iteration's forward pass; so too under
    Megatron-FSDP's ``optim`` and ``optim_grads``, and under ``optim_grads_params`` (ZeRO-3)
    the 1.5 x bytes are three such phases: the reduce-scatter and two parameter all-gathers.
    """
    if cfg.dp == 1:
        return 0.0
    crosses = group_crosses_nodes("dp", cfg, cluster.gpus_per_node)
    total = _collective_time(cluster, dp_allreduce_bytes(model, cfg, grad_bytes), crosses)
    if not cfg.overlap_grad_reduce:
        return total
    v, p = cfg.v, cfg.p
    chunk_bwd = backward_mb / v
    # ready time of chunk j's reduction, measured back from the end of the backward pass
    ready = sorted((chunk_bwd + j * p * chunk_bwd for j in range(v)), reverse=True)
    sharded = cfg.sharding != "no_shard"
    phase = total / (3 if cfg.sharding == "optim_grads_params" else 2) if sharded else total
    finish = -math.inf
    for r in ready:
        finish = max(finish, -r) + phase / v
    exposed = max(0.0, finish)
    if sharded:                 # the parameter all-gather(s) mirror it: in the next forward
        exposed *= 3 if cfg.sharding == "optim_grads_params" else 2   # (and the backward)
    return exposed


EFFECTS = ("elementwise", "tp_comm", "pp_p2p", "bubble", "dp_comm", "optimizer")


def predict_iteration(model: ModelShape, cfg: ParallelConfig, cluster: Cluster,
                      dtype_bytes: int = 2, grad_bytes: int = 2,
                      ignore: Sequence[str] = (), host_overhead_s: float = 0.0
                      ) -> IterationPrediction:
    """Predict one training iteration of ``model`` split by ``cfg`` on ``cluster``.

    Per micro-batch on the slowest stage (the last, which also computes the logits):
    matmul time = its hardware FLOPs / t / (peak · matmul_efficiency); memory-bound time =
    :data:`ELEMENTWISE_PASSES` (+1 when recomputing) × Korthikanti's activation bytes / HBM
    bandwidth; TP time = the layer's collectives (:func:`tp_comm_per_layer`) at the TP group's
    link, plus the vocabulary-parallel cross entropy's (and embedding's) all-reduces; p2p =
    one activation out and one gradient back per model chunk. The pipeline takes
    (m + (p-1)/v) such micro-batch times (Narayanan et al. 2021 §2.2), i.e. the bubble is
    ``bubble_fraction(p, m, v)`` of the busy time. Then the DP gradient all-reduce (exposed
    part) and the Adam step. ``ignore``: effects of :data:`EFFECTS` to leave out (what-if
    studies: which effect matters). ``dtype_bytes`` / ``grad_bytes``: widths of the weights
    (and activations) and of the gradients, 2 or 4; memory counts Megatron's bytes per
    parameter for that pair (:func:`~mpu_lab.perf.cost_model.optimizer_state.bytes_per_parameter`:
    20 for 2/2, 18 for 2/4, 16 for 4/4). ``host_overhead_s``: seconds per iteration of host work
    that does not scale with the width (see the module docstring), added as ``framework_s``.
    Raises ValueError for an invalid configuration.
    """
    cfg.check(model)
    if not host_overhead_s >= 0:
        raise ValueError(f"host_overhead_s must be >= 0 seconds, got {host_overhead_s!r}")
    unknown = set(ignore) - set(EFFECTS)
    if unknown:
        raise ValueError(f"ignore: unknown effects {sorted(unknown)}; valid: {EFFECTS}")
    keep = {e: 0.0 if e in ignore else 1.0 for e in EFFECTS}
    t, p, v, m, b = cfg.tp, cfg.pp, cfg.v, cfg.m, cfg.b
    f = flops_per_token(model)
    tokens_mb = b * model.s
    layers = model.L / p
    share = recomputed_share(model, cfg)          # of the layers, full recomputation
    extra = {"none": 0.0, "selective": f["attention_core"],
             "full": share * f["layer"]}[cfg.recompute]
    layer_flops_mb = tokens_mb * (3 * f["layer"] + extra) / t
    logits_flops_mb = tokens_mb * 3 * f["logits"] / t
    rate = cluster.peak_flops * cluster.matmul_efficiency
    matmul_mb = (layers * layer_flops_mb + logits_flops_mb) / rate
    passes = ELEMENTWISE_PASSES + share
    traffic = layer_activation_bytes(model, cfg, stored=False) * passes * layers
    if cfg.recompute == "selective" and not cfg.flash_attention:
        traffic += score_bytes(model, cfg) * layers        # the softmax written again
    elementwise_mb = keep["elementwise"] * traffic * dtype_bytes / 2 / cluster.hbm_bandwidth
    tp = tp_comm_per_layer(model, cfg, dtype_bytes)
    tp_mb = keep["tp_comm"] * layers * _collective_time(cluster, tp["bytes"], group_crosses_nodes(
        "tp", cfg, cluster.gpus_per_node), tp["count"])
    if t > 1:
        # the vocabulary-parallel cross entropy's three all-reduces of b·s fp32 values (max,
        # sum of exponentials, target logit) on the last stage; with p = 1 that stage also
        # holds the embedding, whose forward output is all-reduced (b·s·h)
        crosses = group_crosses_nodes("tp", cfg, cluster.gpus_per_node)
        ring = ring_all_reduce_factor(t)
        vocab = _collective_time(cluster, 3 * ring * tokens_mb * 4, crosses, 3)
        if p == 1:
            vocab += _collective_time(cluster, ring * tokens_mb * model.h * dtype_bytes, crosses)
        tp_mb += keep["tp_comm"] * vocab
    if cfg.overlap_tp_comm:
        tp_mb = max(0.0, tp_mb - matmul_mb)
    p2p_mb = keep["pp_p2p"] * 2 * v * _collective_time(
        cluster, pipeline_p2p_bytes(model, cfg, dtype_bytes),
        group_crosses_nodes("pp", cfg, cluster.gpus_per_node), 1 if p > 1 else 0)
    if cfg.overlap_p2p_comm:
        p2p_mb = max(0.0, p2p_mb - matmul_mb)
    per_mb = matmul_mb + elementwise_mb + tp_mb + p2p_mb
    bubble = keep["bubble"] * (p - 1) / v * per_mb
    dp_time = keep["dp_comm"] * _dp_exposed_time(model, cfg, cluster, grad_bytes,
                               backward_mb=(2 / 3) * (matmul_mb + elementwise_mb))
    n_gpu = parameters_per_gpu(model, cfg, "first")
    if cfg.sharding != "no_shard":
        n_gpu /= cfg.dp
    optimizer = keep["optimizer"] * n_gpu * ADAM_STEP_BYTES_PER_PARAM / cluster.hbm_bandwidth
    total = m * per_mb + bubble + dp_time + optimizer + host_overhead_s
    return IterationPrediction(
        model=model, config=cfg, cluster=cluster,
        compute_s=m * (matmul_mb + elementwise_mb), matmul_s=m * matmul_mb,
        elementwise_s=m * elementwise_mb, tp_comm_s=m * tp_mb, pp_p2p_s=m * p2p_mb,
        bubble_s=bubble, dp_comm_s=dp_time, optimizer_s=optimizer, total_s=total,
        model_flops=model_flops_per_iteration(model, cfg.global_batch_size),
        hardware_flops=hardware_flops_per_iteration(model, cfg.global_batch_size, cfg.recompute,
                                                    share),
        memory=memory_per_gpu(model, cfg, dtype_bytes, grad_bytes), framework_s=host_overhead_s)


def recompute_label(cfg: ParallelConfig) -> str:
    """``none``, ``selective``, ``full``, or ``full:N`` (Megatron's block method, N layers)."""
    n = cfg.recompute_num_layers
    return cfg.recompute + (f":{n}" if cfg.recompute == "full" and n else "")


def pick_recompute(model: ModelShape, cfg: ParallelConfig, cluster: Cluster,
                   dtype_bytes: int = 2, grad_bytes: int = 2) -> IterationPrediction:
    """The fastest recomputation that fits for this split (Korthikanti et al. 2022 §5): none,
    selective, Megatron-core's block method with the fewest layers per model chunk that fits
    (memory falls and time grows with each layer recomputed), or full; when none of them fits,
    the one that needs the least memory. Returns its prediction (``.config`` says which)."""
    def predict(recompute, n=None):
        return predict_iteration(model, dataclasses.replace(cfg, recompute=recompute,
                                                            recompute_num_layers=n),
                                 cluster, dtype_bytes, grad_bytes)
    options = [predict("none"), predict("selective"), predict("full")]
    low, high = 1, model.L // (cfg.pp * cfg.v) - 1
    if low <= high:
        while low < high:
            middle = (low + high) // 2
            if predict("full", middle).fits:
                high = middle
            else:
                low = middle + 1
        options.append(predict("full", low))
    fitting = [o for o in options if o.fits]
    if fitting:
        return min(fitting, key=lambda o: o.total_s)
    return min(options, key=lambda o: o.memory["total"])
