"""The cost model's inputs: a GPT's shape, how it is split, the hardware; the papers' presets.

* :class:`ModelShape` — L, h, a, s, V (and the ffn size, 4h by default);
* :class:`ParallelConfig` — t, p, d, v, micro-batch b, global batch B (m = B / (b·d)), sequence
  parallelism, recomputation (Korthikanti et al. 2022 §5), the 1F1B or GPipe schedule
  (Narayanan et al. 2021 §2.2), the distributed optimizer (ZeRO stage 1, Rajbhandari et al.
  2020) and Megatron-core's overlap switches; :meth:`ParallelConfig.problems` lists why a split
  cannot run a model;
* :class:`Cluster` — per-GPU peak FLOP/s, link and HBM bandwidths, memory, and the achievable
  matmul and bandwidth efficiencies;
* presets from datasheets and papers: :data:`DGX_A100_80GB`, :data:`DGX_H100`
  (:data:`CLUSTERS`), :data:`GPT2_SMALL`, :data:`GPT3_175B` (:data:`MODELS`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["RECOMPUTE_MODES", "SCHEDULES", "ModelShape", "ParallelConfig", "Cluster",
           "DGX_A100_80GB", "DGX_H100", "CLUSTERS", "GPT2_SMALL", "GPT3_175B", "MODELS"]

RECOMPUTE_MODES = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe")
# Megatron-FSDP's --data-parallel-sharding-strategy (cost_model.fsdp holds the same tuple)
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


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
    interleaved schedule's overlapped send/recv. ``recompute_num_layers`` N (with ``"full"``):
    Megatron-core's ``recompute_method="block"``, only the first N layers of each model chunk
    (of ``L/(p·v)``) recompute their forward and keep only their input, the rest keep
    everything; ``None`` recomputes every layer (``"uniform"`` with one layer per group).
    ``data_parallel_sharding_strategy`` (Megatron-FSDP, ``--use-megatron-fsdp``): ``"no_shard"``,
    ``"optim"`` (ZeRO-1, what ``distributed_optimizer`` gives), ``"optim_grads"`` (ZeRO-2: the
    gradients too) or ``"optim_grads_params"`` (ZeRO-3: the weights too, all-gathered before
    each unit's forward and backward: 1.5 x the data-parallel bytes); ``None``: not
    Megatron-FSDP, ``distributed_optimizer`` decides (:attr:`sharding`).
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
    recompute_num_layers: Optional[int] = None
    data_parallel_sharding_strategy: Optional[str] = None

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

    @property
    def sharding(self) -> str:
        """What each data-parallel rank keeps 1/d of, as Megatron-FSDP names it: the strategy,
        or ``"optim"`` with the distributed optimizer, else ``"no_shard"``."""
        if self.data_parallel_sharding_strategy is not None:
            return self.data_parallel_sharding_strategy
        return "optim" if self.distributed_optimizer else "no_shard"

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
        strategy = self.data_parallel_sharding_strategy
        if strategy is not None and strategy not in SHARDING_STRATEGIES:
            out.append(f"data_parallel_sharding_strategy must be one of "
                       f"{', '.join(SHARDING_STRATEGIES)} or None, got {strategy!r}")
        if strategy is not None and self.distributed_optimizer:
            out.append(f"data_parallel_sharding_strategy {strategy!r} with distributed_optimizer: "
                       f"Megatron-FSDP shards the optimizer states itself ('optim' is the "
                       f"distributed optimizer's sharding)")
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
        n = self.recompute_num_layers
        if n is not None:
            if self.recompute != "full":
                out.append(f"recompute_num_layers {n} needs recompute 'full' (Megatron's block "
                           f"method), got recompute {self.recompute!r}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                out.append(f"recompute_num_layers must be a positive integer or None, got {n!r}")
            elif model is not None and n > model.num_layers // (self.pp * self.virtual_stages):
                out.append(f"recompute_num_layers {n} is more than the "
                           f"{model.num_layers // (self.pp * self.virtual_stages)} layers of a "
                           f"model chunk (L / (pp x virtual_stages))")
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
    fitted per GPU generation (:func:`mpu_lab.perf.published_runs.fit_matmul_efficiency`).
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
# published run (mpu_lab.perf.published_runs: A100 on the 1T run of Narayanan et al. 2021, H100 on
# Megatron-core's 175B run on 96 GPUs), rounded; tests/perf/cost_model/test_cost_model.py keeps
# them in step.
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
