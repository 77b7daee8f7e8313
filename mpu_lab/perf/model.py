"""Analytic cost model of model-parallel GPT training: FLOPs, communication, bubble, memory, time.

Inputs are three small dataclasses — :class:`ModelShape` (L, h, a, s, V), :class:`ParallelConfig`
(t, p, d, v, micro-batch b, global batch B, sequence parallelism, recomputation) and
:class:`Cluster` (GPUs per node, peak FLOP/s, link bandwidths, an achievable matmul
efficiency) — and :func:`predict_iteration` turns them into a time breakdown of one training
iteration, TFLOP/s per GPU, MFU and memory per GPU.

Sources, one per formula (each function's docstring says which):

* Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (arXiv:2104.04473): parameter count and FLOPs (§5.1), pipeline bubble (§2.2),
  tensor-parallel communication (§3.3), scatter/gather of pipeline messages (§4.1).
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198): activation memory per layer (§4, Table 2), in-flight micro-batches of
  1F1B and interleaved schedules (§4.2.3), MFU vs HFU (§6).
* Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models" (arXiv:1910.02054) §3.1: mixed-precision Adam keeps 16 bytes per parameter.
* Patarasuk & Yuan 2009 / NCCL's performance notes: a ring all-reduce moves 2(n-1)/n of the
  message through every GPU's link, all-gather and reduce-scatter (n-1)/n.

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
  interleaved schedule's (p-1)/v.
* Not modelled: kernel launch and Python overhead, data loading, imbalance other than the
  logits, network contention between groups, stragglers, the gradient-norm and logging
  reductions, the data broadcast inside the TP group.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Sequence

__all__ = [
    "activation_memory_per_layer", "ModelShape", "ParallelConfig", "Cluster",
    "DGX_A100_80GB", "DGX_H100", "CLUSTERS", "RECOMPUTE_MODES", "SCHEDULES",
    "GPT2_SMALL", "GPT3_175B", "MODELS", "group_crosses_nodes",
    "parameter_count", "parameters_per_gpu", "model_flops_per_iteration",
    "hardware_flops_per_iteration", "flops_per_token", "bubble_fraction",
    "ring_all_reduce_factor", "tp_comm_per_layer", "pipeline_p2p_bytes",
    "dp_allreduce_bytes", "in_flight_microbatches", "memory_per_gpu",
    "IterationPrediction", "predict_iteration", "EFFECTS",
]

RECOMPUTE_MODES = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe")
ELEMENTWISE_PASSES = 4           # forward write, backward read, gradient write + read
ADAM_STEP_BYTES_PER_PARAM = 28   # reads fp32 param, m, v + 16-bit grad (14 B), writes them back
BYTES_PER_PARAM_ADAM = 16        # ZeRO §3.1: fp16 weight 2 + fp16 grad 2 + fp32 copy, m, v 12


def activation_memory_per_layer(s: int, b: int, h: int, a: int, t: int = 1,
                                sp: bool = False) -> float:
    """Bytes of activations one transformer layer stores (Korthikanti et al. 2022, Table 2).

    With 16-bit activations and dropout, sequence ``s``, micro-batch ``b``, hidden ``h``,
    ``a`` heads, tensor-parallel size ``t``:

    =====================================  ============================================
    no parallelism                         ``s b h (34 + 5 a s / h)``
    tensor parallelism                     ``s b h (10 + 24 / t + 5 a s / (h t))``
    tensor + sequence parallelism          ``s b h / t (34 + 5 a s / h)``
    =====================================  ============================================

    ``t = 1`` gives the no-parallelism row whatever ``sp`` is (all three rows agree there).
    The term-by-term derivation and a measurement of what this package's layer really keeps
    are in :mod:`mpu_lab.models.memory`.
    """
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    sbh = s * b * h
    attention = 5 * a * s / h          # the softmax, its dropout mask and the dropout output
    if sp:
        return sbh / t * (34 + attention)
    return sbh * (10 + 24 / t + attention / t)


# --------------------------------------------------------------------------- inputs
@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A GPT's shape: ``L`` layers, hidden ``h``, ``a`` heads, sequence ``s``, vocabulary ``V``.

    ``ffn_hidden_size`` defaults to 4h (Megatron's default and the papers' assumption).
    """
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: Optional[int] = None
    name: str = ""

    def __post_init__(self):
        for field in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                      "vocab_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{field} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            raise ValueError(f"ffn_hidden_size must be >= 1, got {self.ffn_hidden_size}")

    # the papers' one-letter names
    L = property(lambda self: self.num_layers)
    h = property(lambda self: self.hidden_size)
    a = property(lambda self: self.num_attention_heads)
    s = property(lambda self: self.seq_length)
    V = property(lambda self: self.vocab_size)
    ffn = property(lambda self: self.ffn_hidden_size or 4 * self.hidden_size)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How a model is split: tensor ``tp`` (t), pipeline ``pp`` (p), data ``dp`` (d) sizes.

    ``micro_batch_size`` b and ``global_batch_size`` B give m = B / (b·d) micro-batches per
    pipeline; ``virtual_stages`` v > 1 means the interleaved 1F1B schedule. ``recompute`` is
    ``"none"``, ``"selective"`` (the attention core, Korthikanti §5) or ``"full"`` (every
    layer's forward, keeping only its input). ``flash_attention`` means a fused attention that
    never stores the s×s scores (same activation memory as selective recomputation).
    ``distributed_optimizer`` shards the fp32 optimizer states over d (ZeRO stage 1).
    The ``overlap_*`` switches mirror Megatron-core's ``--overlap-grad-reduce`` (with the
    distributed optimizer also ``--overlap-param-gather``), ``--tp-comm-overlap`` and the
    interleaved schedule's overlapped send/recv.
    """
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    global_batch_size: int = 1
    virtual_stages: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    schedule: str = "1f1b"
    flash_attention: bool = False
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_tp_comm: bool = False
    overlap_p2p_comm: bool = False

    t = property(lambda self: self.tp)
    p = property(lambda self: self.pp)
    d = property(lambda self: self.dp)
    v = property(lambda self: self.virtual_stages)
    b = property(lambda self: self.micro_batch_size)

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        """m = B / (b·d): micro-batches each pipeline runs per iteration."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    m = property(lambda self: self.num_microbatches)

    def problems(self, model: Optional[ModelShape] = None) -> list:
        """Every reason this configuration cannot run ``model`` (empty list: it can)."""
        out = []
        for field in ("tp", "pp", "dp", "micro_batch_size", "global_batch_size",
                      "virtual_stages"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                out.append(f"{field} must be a positive integer, got {value!r}")
        if out:
            return out
        if self.recompute not in RECOMPUTE_MODES:
            out.append(f"recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if self.schedule not in SCHEDULES:
            out.append(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.global_batch_size % (self.micro_batch_size * self.dp):
            out.append(f"global batch {self.global_batch_size} is not divisible by micro-batch "
                       f"{self.micro_batch_size} x data-parallel {self.dp} = "
                       f"{self.micro_batch_size * self.dp}")
        if self.virtual_stages > 1:
            if self.pp == 1:
                out.append(f"virtual_stages {self.virtual_stages} needs pipeline parallelism "
                           f"(pp > 1)")
            if self.schedule != "1f1b":
                out.append("virtual stages need the (interleaved) 1f1b schedule")
            elif self.global_batch_size % (self.micro_batch_size * self.dp) == 0 \
                    and self.num_microbatches % self.pp:
                out.append(f"the interleaved schedule needs m = {self.num_microbatches} "
                           f"micro-batches to be a multiple of pp = {self.pp}")
        if self.sequence_parallel and self.tp == 1:
            out.append("sequence_parallel needs tp > 1")
        if model is not None:
            if model.num_attention_heads % self.tp:
                out.append(f"tp {self.tp} does not divide num_attention_heads "
                           f"{model.num_attention_heads}")
            if model.ffn % self.tp:
                out.append(f"tp {self.tp} does not divide the ffn size {model.ffn}")
            if model.num_layers % (self.pp * self.virtual_stages):
                out.append(f"pp {self.pp} x virtual_stages {self.virtual_stages} does not divide "
                           f"num_layers {model.num_layers}")
            if self.sequence_parallel and model.seq_length % self.tp:
                out.append(f"sequence_parallel needs tp {self.tp} to divide seq_length "
                           f"{model.seq_length}")
        return out

    def check(self, model: Optional[ModelShape] = None) -> "ParallelConfig":
        """Raise ValueError naming every problem; return self when there is none."""
        problems = self.problems(model)
        if problems:
            raise ValueError(f"invalid parallel configuration (t={self.tp}, p={self.pp}, "
                             f"d={self.dp}, v={self.virtual_stages}, b={self.micro_batch_size}, "
                             f"B={self.global_batch_size}): " + "; ".join(problems))
        return self


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The hardware: per-GPU peak and bandwidths, bytes and FLOP/s (not TB or TFLOP).

    ``peak_flops``: dense matmul peak for the training dtype. ``intra_node_bandwidth`` and
    ``inter_node_bandwidth``: one direction of one GPU's NVLink and network port (what nccl-tests
    calls bus bandwidth at best). ``bandwidth_efficiency``: the share of it a large collective
    achieves. ``matmul_efficiency``: the share of peak large GEMMs achieve — the one constant
    fitted per GPU generation (:func:`mpu_lab.perf.calibrate.fit_matmul_efficiency`).
    """
    name: str
    gpus_per_node: int
    peak_flops: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    hbm_bandwidth: float
    memory_bytes: float
    matmul_efficiency: float = 0.7
    bandwidth_efficiency: float = 0.8
    latency_s: float = 10e-6
    num_nodes: Optional[int] = None

    def __post_init__(self):
        for field in ("gpus_per_node", "peak_flops", "intra_node_bandwidth",
                      "inter_node_bandwidth", "hbm_bandwidth", "memory_bytes"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Cluster.{field} must be > 0, got {getattr(self, field)!r}")
        for field in ("matmul_efficiency", "bandwidth_efficiency"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"Cluster.{field} must be in (0, 1], got "
                                 f"{getattr(self, field)!r}")
        if self.latency_s < 0:
            raise ValueError(f"Cluster.latency_s must be >= 0, got {self.latency_s!r}")

    def replace(self, **changes) -> "Cluster":
        return dataclasses.replace(self, **changes)

    @property
    def num_gpus(self) -> Optional[int]:
        return None if self.num_nodes is None else self.num_nodes * self.gpus_per_node


# Datasheet figures; matmul_efficiency is the one constant fitted per GPU generation on one
# published run (mpu_lab.perf.calibrate: A100 on the 1T run of Narayanan et al. 2021, H100 on
# Megatron-core's 175B run on 96 GPUs), rounded; tests/test_perf_model.py keeps them in step.
# NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): BF16/FP16 dense
# 312 TFLOP/s, HBM2e 2,039 GB/s, NVLink 600 GB/s (both directions, so 300 GB/s each way).
# DGX A100 datasheet: 8 GPUs, 8 single-port 200 Gb/s HDR InfiniBand (25 GB/s per GPU) — the
# Selene nodes of Narayanan et al. 2021 §5.
DGX_A100_80GB = Cluster(
    name="DGX A100 80GB", gpus_per_node=8, peak_flops=312e12,
    intra_node_bandwidth=300e9, inter_node_bandwidth=25e9, hbm_bandwidth=2.039e12,
    memory_bytes=80e9, matmul_efficiency=0.69)
# NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 dense 989 TFLOP/s (1,979 with sparsity),
# HBM3 3.35 TB/s, NVLink 900 GB/s (450 GB/s each way). DGX H100 datasheet: 8 GPUs,
# 8 ConnectX-7 400 Gb/s ports for compute traffic (50 GB/s per GPU).
DGX_H100 = Cluster(
    name="DGX H100", gpus_per_node=8, peak_flops=989e12,
    intra_node_bandwidth=450e9, inter_node_bandwidth=50e9, hbm_bandwidth=3.35e12,
    memory_bytes=80e9, matmul_efficiency=0.51)
CLUSTERS = {"dgx-a100-80gb": DGX_A100_80GB, "dgx-h100": DGX_H100}


# Model shapes from the papers: GPT-2 small (Radford et al. 2019, Table 2: 12 layers, d_model
# 768, 1024 context, vocabulary 50,257; 12 heads in the released code) and GPT-3 175B (Brown
# et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads, context 2048; GPT-2's vocabulary).
GPT2_SMALL = ModelShape(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024,
                        vocab_size=50257, name="GPT-2 small")
GPT3_175B = ModelShape(num_layers=96, hidden_size=12288, num_attention_heads=96,
                       seq_length=2048, vocab_size=50257, name="GPT-3 175B")
MODELS = {"gpt2-small": GPT2_SMALL, "gpt3-175b": GPT3_175B}


# --------------------------------------------------------------------------- counts
def parameter_count(model: ModelShape) -> int:
    """Parameters of a GPT (Narayanan et al. 2021 §5.1):
    ``P = 12 L h² (1 + 13/(12h) + (V + s)/(12 L h))``.

    Per layer: QKV and output projections 4h² + 4h, the MLP 2·h·ffn + ffn + h, two layer norms
    4h (= 12h² + 13h for ffn = 4h); plus word and position embeddings (V + s)·h. Like the paper
    it leaves out the final layer norm (2h) and counts the tied output layer once.
    """
    h, f = model.h, model.ffn
    per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    return model.L * per_layer + (model.V + model.s) * h


def parameters_per_gpu(model: ModelShape, cfg: ParallelConfig, stage: str = "first") -> float:
    """Parameters one GPU holds: its L/p layers split t ways, plus the word embedding (split t
    ways, on the first stage and — tied weights, Megatron keeps a copy — on the last) and the
    position embedding (first stage). Layer norms and biases of the row-parallel layers are
    replicated, treated here as split (a <0.1 % error)."""
    h, f = model.h, model.ffn
    per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    n = model.L / cfg.pp * per_layer / cfg.tp
    if stage == "first" or cfg.pp == 1:
        n += model.V * h / cfg.tp + model.s * h
    elif stage == "last":
        n += model.V * h / cfg.tp
    return n


def flops_per_token(model: ModelShape) -> Dict[str, float]:
    """Matmul FLOPs per token, forward pass (Narayanan et al. 2021 §5.1, generalised to ffn).

    One layer: QKV + output projection 2·4h², MLP 2·2h·ffn, attention scores QKᵀ and the
    weighted sum of values 2·2·s·h (the full s×s product, as the paper counts it); logits 2hV.
    """
    layer = 2 * (4 * model.h ** 2 + 2 * model.h * model.ffn) + 4 * model.s * model.h
    return dict(layer=float(layer), attention_core=4.0 * model.s * model.h,
                logits=2.0 * model.h * model.V)


def model_flops_per_iteration(model: ModelShape, global_batch_size: int) -> float:
    """Model FLOPs of one iteration (forward + backward = 3 × forward, no recomputation):
    ``72 B s L h² (1 + s/(6h) + V/(12 L h))`` for ffn = 4h — Narayanan et al. 2021 §5.1 without
    the recomputation pass, i.e. 6N + 12·L·h·s per token (N without embeddings, plus 6hV for the
    logits). MFU counts these (Korthikanti et al. 2022 §6)."""
    f = flops_per_token(model)
    return 3.0 * global_batch_size * model.s * (model.L * f["layer"] + f["logits"])


def hardware_flops_per_iteration(model: ModelShape, global_batch_size: int,
                                 recompute: str = "none") -> float:
    """FLOPs the GPUs really execute: model FLOPs plus recomputation.

    ``full``: one more forward of every layer — Narayanan et al. 2021 §5.1's
    ``96 B s L h² (1 + s/(6h) + V/(16 L h))`` (8N + 16·L·h·s per token); the paper's reported
    TFLOP/s count these. ``selective``: one more attention core (QKᵀ and the weighted sum),
    Korthikanti et al. 2022 §5.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    f = flops_per_token(model)
    extra = {"none": 0.0, "selective": f["attention_core"], "full": f["layer"]}[recompute]
    tokens = global_batch_size * model.s
    return model_flops_per_iteration(model, global_batch_size) + tokens * model.L * extra


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Pipeline bubble relative to the ideal compute time: ``(p-1)/m`` for GPipe and 1F1B, and
    ``(p-1)/(v·m)`` for the interleaved schedule with v model chunks per GPU (Narayanan et al.
    2021 §2.2.1–2.2.2). Its share of the whole iteration is ``(p-1)/(v·m + p-1)``."""
    for name, value in (("p", p), ("m", m), ("v", v)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return (p - 1) / (v * m)


def ring_all_reduce_factor(n: int) -> float:
    """Bytes each GPU sends per byte of message in a ring all-reduce: ``2(n-1)/n`` (a
    reduce-scatter then an all-gather, each ``(n-1)/n``; nccl-tests' busbw factor)."""
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    return 2 * (n - 1) / n


def _collectives_per_layer(cfg: ParallelConfig) -> int:
    # Narayanan et al. 2021 §3.3 / Fig. 4: the f and g of the MLP and attention blocks give two
    # all-reduces in the forward pass and two in the backward; recomputing the forward
    # (full recomputation) runs the forward's two again. With sequence parallelism each
    # all-reduce becomes an all-gather + reduce-scatter pair of the same total volume
    # (Korthikanti et al. 2022 §4.2.2), so counting all-reduce equivalents covers both.
    return 4 + (2 if cfg.recompute == "full" else 0)


def tp_comm_per_layer(model: ModelShape, cfg: ParallelConfig, dtype_bytes: int = 2
                      ) -> Dict[str, float]:
    """Tensor-parallel traffic of one layer for one micro-batch, per GPU (Narayanan et al. 2021
    §3.3): ``count`` all-reduces (or AG + RS pairs) of ``b·s·h`` elements each, and ``bytes``
    each GPU sends in total: count × 2(t-1)/t × b·s·h × dtype_bytes."""
    count = _collectives_per_layer(cfg) if cfg.tp > 1 else 0
    message = cfg.b * model.s * model.h * dtype_bytes
    return dict(count=count, message_bytes=float(message),
                bytes=count * ring_all_reduce_factor(cfg.tp) * message)


def pipeline_p2p_bytes(model: ModelShape, cfg: ParallelConfig, dtype_bytes: int = 2) -> float:
    """Bytes one stage boundary carries per micro-batch in one direction: the ``b·s·h``
    activation, each of the t tensor-parallel ranks sending 1/t of it (the scatter/gather
    optimisation, Narayanan et al. 2021 §4.1; with sequence parallelism it is already split)."""
    if cfg.pp == 1:
        return 0.0
    return cfg.b * model.s * model.h * dtype_bytes / cfg.tp


def dp_allreduce_bytes(model: ModelShape, cfg: ParallelConfig, grad_bytes: int = 2) -> float:
    """Bytes each GPU sends in the data-parallel gradient all-reduce of one iteration:
    ``2(d-1)/d × params_per_gpu × grad_bytes`` (ring all-reduce; with the distributed optimizer
    a reduce-scatter of gradients plus an all-gather of parameters moves the same)."""
    return ring_all_reduce_factor(cfg.dp) * parameters_per_gpu(model, cfg) * grad_bytes


def in_flight_microbatches(cfg: ParallelConfig) -> float:
    """Micro-batches whose activations the first stage holds at its peak: GPipe all m; 1F1B
    min(p, m) (Narayanan et al. 2021 §2.2.1); interleaved 1F1B p·(1 + (p-1)/(p·v)) micro-batch
    equivalents of a full stage (Korthikanti et al. 2022 §4.2.3)."""
    if cfg.schedule == "gpipe":
        return float(cfg.m)
    if cfg.v > 1:
        return cfg.p * (1 + (cfg.p - 1) / (cfg.p * cfg.v))
    return float(min(cfg.p, cfg.m))


def _layer_activation_bytes(model: ModelShape, cfg: ParallelConfig, stored: bool) -> float:
    """Korthikanti Table 2 for one layer and one micro-batch. ``stored``: what the backward
    keeps (recomputation shrinks it); otherwise what the forward writes (for traffic)."""
    sp = cfg.sequence_parallel
    full = activation_memory_per_layer(model.s, cfg.b, model.h, model.a, cfg.tp, sp)
    no_scores = full - _score_bytes(model, cfg)
    if stored and cfg.recompute == "full":
        # only the layer's input survives: 2sbh bytes, split t ways with sequence parallelism
        return 2 * model.s * cfg.b * model.h / (cfg.tp if sp else 1)
    if cfg.flash_attention or (stored and cfg.recompute == "selective"):
        return no_scores
    return full


def _score_bytes(model: ModelShape, cfg: ParallelConfig) -> float:
    # the 5as²b/t of Table 2: softmax output, its dropout mask and the dropout's output
    return 5 * model.a * model.s * model.s * cfg.b / cfg.tp


def memory_per_gpu(model: ModelShape, cfg: ParallelConfig, dtype_bytes: int = 2
                   ) -> Dict[str, float]:
    """Bytes on the busiest GPU (the first pipeline stage), by kind.

    Weights, gradients and optimizer states of mixed-precision Adam: 16 bytes per parameter
    (ZeRO, Rajbhandari et al. 2020 §3.1: fp16 weight 2 + fp16 gradient 2 + fp32 weight,
    momentum and variance 12); the distributed optimizer divides the 12 by d. Activations:
    Korthikanti et al. 2022 Table 2 (16-bit; scaled by dtype_bytes/2) per layer × L/p layers ×
    the schedule's in-flight micro-batches (1F1B keeps up to p on stage 0, §4.2.3); with full
    recomputation one layer's full activations are live again during its backward, counted
    once. Not counted: the embedding and logits activations, temporary buffers, fragmentation.
    """
    n = parameters_per_gpu(model, cfg, "first")
    weights, grads = dtype_bytes * n, dtype_bytes * n
    optimizer = (BYTES_PER_PARAM_ADAM - 2 * dtype_bytes) * n
    if cfg.distributed_optimizer:
        optimizer /= cfg.dp
    layers_per_stage = model.L / cfg.pp
    scale = dtype_bytes / 2             # Table 2 counts 16-bit activations
    activations = (_layer_activation_bytes(model, cfg, stored=True) * layers_per_stage
                   * in_flight_microbatches(cfg)) * scale
    if cfg.recompute == "full":
        activations += _layer_activation_bytes(model, cfg, stored=False) * scale
    return dict(weights=weights, gradients=grads, optimizer=optimizer, activations=activations,
                total=weights + grads + optimizer + activations)


# --------------------------------------------------------------------------- time
@dataclasses.dataclass(frozen=True)
class IterationPrediction:
    """What :func:`predict_iteration` returns: seconds per iteration by cause, throughput, memory.

    ``compute_s`` (matmuls + memory-bound ops, all m micro-batches of the slowest stage),
    ``tp_comm_s``, ``pp_p2p_s`` and ``bubble_s`` are on the critical path as described in the
    module docstring; ``dp_comm_s`` is the exposed part of the gradient all-reduce;
    ``optimizer_s`` the Adam step. ``total_s`` is their sum.
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
        """Seconds per iteration by cause, in a fixed order (for tables and stacked bars)."""
        return {"compute": self.compute_s, "tp_comm": self.tp_comm_s, "pp_p2p": self.pp_p2p_s,
                "bubble": self.bubble_s, "dp_comm": self.dp_comm_s,
                "optimizer": self.optimizer_s}

    def shares(self) -> Dict[str, float]:
        return {k: v / self.total_s for k, v in self.breakdown().items()}

    def summary(self) -> str:
        """A few rounded lines: time by cause, throughput, memory (deterministic)."""
        c = self.config
        lines = [f"{self.model.name or 'model'} on {c.num_gpus} GPUs ({self.cluster.name}): "
                 f"t={c.tp} p={c.pp} d={c.dp} v={c.v} b={c.b} m={c.m}, recompute {c.recompute}"
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
    all-gather that hides the same way behind the next iteration's forward pass.
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
    phase = total / 2 if cfg.distributed_optimizer else total   # reduce-scatter | all-reduce
    finish = -math.inf
    for r in ready:
        finish = max(finish, -r) + phase / v
    exposed = max(0.0, finish)
    if cfg.distributed_optimizer:
        exposed *= 2            # the parameter all-gather mirrors it in the next forward
    return exposed


EFFECTS = ("elementwise", "tp_comm", "pp_p2p", "bubble", "dp_comm", "optimizer")


def predict_iteration(model: ModelShape, cfg: ParallelConfig, cluster: Cluster,
                      dtype_bytes: int = 2, grad_bytes: int = 2,
                      ignore: Sequence[str] = ()) -> IterationPrediction:
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
    studies: which effect matters). Raises ValueError for an invalid configuration.
    """
    cfg.check(model)
    unknown = set(ignore) - set(EFFECTS)
    if unknown:
        raise ValueError(f"ignore: unknown effects {sorted(unknown)}; valid: {EFFECTS}")
    keep = {e: 0.0 if e in ignore else 1.0 for e in EFFECTS}
    t, p, v, m, b = cfg.tp, cfg.pp, cfg.v, cfg.m, cfg.b
    f = flops_per_token(model)
    tokens_mb = b * model.s
    layers = model.L / p
    extra = {"none": 0.0, "selective": f["attention_core"], "full": f["layer"]}[cfg.recompute]
    layer_flops_mb = tokens_mb * (3 * f["layer"] + extra) / t
    logits_flops_mb = tokens_mb * 3 * f["logits"] / t
    rate = cluster.peak_flops * cluster.matmul_efficiency
    matmul_mb = (layers * layer_flops_mb + logits_flops_mb) / rate
    passes = ELEMENTWISE_PASSES + (1 if cfg.recompute == "full" else 0)
    traffic = _layer_activation_bytes(model, cfg, stored=False) * passes * layers
    if cfg.recompute == "selective" and not cfg.flash_attention:
        traffic += _score_bytes(model, cfg) * layers        # the softmax written again
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
    if cfg.distributed_optimizer:
        n_gpu /= cfg.dp
    optimizer = keep["optimizer"] * n_gpu * ADAM_STEP_BYTES_PER_PARAM / cluster.hbm_bandwidth
    total = m * per_mb + bubble + dp_time + optimizer
    return IterationPrediction(
        model=model, config=cfg, cluster=cluster,
        compute_s=m * (matmul_mb + elementwise_mb), matmul_s=m * matmul_mb,
        elementwise_s=m * elementwise_mb, tp_comm_s=m * tp_mb, pp_p2p_s=m * p2p_mb,
        bubble_s=bubble, dp_comm_s=dp_time, optimizer_s=optimizer, total_s=total,
        model_flops=model_flops_per_iteration(model, cfg.global_batch_size),
        hardware_flops=hardware_flops_per_iteration(model, cfg.global_batch_size, cfg.recompute),
        memory=memory_per_gpu(model, cfg, dtype_bytes))
