"""Analytic cost model of model-parallel GPT training: FLOPs, communication, bubble, memory, time.

Inputs are three small dataclasses — :class:`ModelShape` (L, h, a, s, V), :class:`ParallelConfig`
(t, p, d, v, micro-batch b, global batch B, sequence parallelism, recomputation) and
:class:`Cluster` (GPUs per node, peak FLOP/s, link bandwidths, an achievable matmul
efficiency) — and :func:`predict_iteration` turns them into a time breakdown of one training
iteration, TFLOP/s per GPU, MFU and memory per GPU. Pure Python: no torch, no processes.

* :mod:`~mpu_lab.perf.cost_model.inputs` — the three inputs and the papers' presets;
* :mod:`~mpu_lab.perf.cost_model.activations` — activation memory per layer, term by term
  (Korthikanti et al. 2022 §4, Table 2);
* :mod:`~mpu_lab.perf.cost_model.counts` — parameters and FLOPs (Narayanan et al. 2021, Appendix eq. (3)),
  bubble (§2.2), communication bytes (§3.3, §4.1), memory per GPU (ZeRO §3.1, Korthikanti
  §4.2.3);
* :mod:`~mpu_lab.perf.cost_model.optimizer_state` — bytes per parameter of weights, gradients
  and Adam's states, as Megatron-core's distributed-optimizer guide gives them;
* :mod:`~mpu_lab.perf.cost_model.fsdp` — Megatron-FSDP's four sharding strategies (ZeRO
  stages 1-3, Rajbhandari et al. 2020 §5): bytes kept per rank and moved per step;
* :mod:`~mpu_lab.perf.cost_model.predict` — the time of one iteration, with the modelling
  assumptions stated plainly in its docstring;
* :mod:`~mpu_lab.perf.cost_model.context` — context parallelism: activation memory divided by
  cp, the ring's (and a2a's, allgather's) bytes per layer, whether the ring hides behind
  attention, a (t, p, d, cp) ranking (Korthikanti et al. 2022; Liu et al. 2023; Jacobs et al.
  2023);
* :mod:`~mpu_lab.perf.cost_model.moe` — mixture of experts: parameters and FLOPs per token with
  E and k, memory per rank with ep, the all-to-all bytes per layer, a (t, p, d, ep) ranking
  (Lepikhin et al. 2020; Fedus et al. 2021; Jiang et al. 2024).

Sources, one per formula (each function's docstring says which):

* Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (arXiv:2104.04473): parameter count and FLOPs (Appendix eq. (3)), pipeline bubble (§2.2),
  tensor-parallel communication (§3.3), scatter/gather of pipeline messages (§4.1).
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198): activation memory per layer (§4, Table 2), in-flight micro-batches of
  1F1B and interleaved schedules (§4.2.3), MFU vs HFU (§6).
* Megatron-core's developer guide, "Distributed Optimizer": bytes per parameter of
  Megatron's mixed-precision Adam, 20 / 18 / 16 for fp16/fp16, bf16/fp32, fp32/fp32, and
  4 + 16/d, 6 + 12/d, 8 + 8/d with the distributed optimizer
  (:mod:`~mpu_lab.perf.cost_model.optimizer_state`, :func:`bytes_per_parameter`). ZeRO's 16
  (Rajbhandari et al. 2020 §3.1) models mixed precision without Megatron's fp32 main gradient.
* Patarasuk & Yuan 2009 / NCCL's performance notes: a ring all-reduce moves 2(n-1)/n of the
  message through every GPU's link, all-gather and reduce-scatter (n-1)/n.
"""
from mpu_lab.perf.cost_model.activations import (  # noqa: F401
    activation_memory_per_layer, layer_activation_terms, paper_terms)
from mpu_lab.perf.cost_model.context import (  # noqa: F401
    CP_COMM_TYPES, ContextParallelPrediction, cp_activation_memory_per_layer,
    cp_comm_bytes_per_layer, cp_memory_per_gpu, predict_context_parallel,
    rank_context_parallel, ring_overlap)
from mpu_lab.perf.cost_model.counts import (  # noqa: F401
    BYTES_PER_PARAM_ADAM, bubble_fraction, dp_allreduce_bytes, flops_per_token,
    hardware_flops_per_iteration, in_flight_microbatches, memory_per_gpu,
    model_flops_per_iteration, parameter_count, parameters_per_gpu, pipeline_p2p_bytes,
    ring_all_reduce_factor, tp_comm_per_layer)
from mpu_lab.perf.cost_model.fsdp import (  # noqa: F401
    DATA_PARALLEL_SHARDING_STRATEGIES, data_parallel_bytes_per_step, resident_bytes_per_rank,
    ring_bytes)
from mpu_lab.perf.cost_model.inputs import (
    CLUSTERS, DGX_A100_80GB, DGX_H100, GPT2_SMALL, GPT3_175B, MODELS, RECOMPUTE_MODES,
    SCHEDULES, Cluster, ModelShape, ParallelConfig)
from mpu_lab.perf.cost_model.moe import (  # noqa: F401
    MIXTRAL_8X7B, MoEModelShape, MoEPrediction, moe_a2a_bytes_per_layer, moe_flops_per_token,
    moe_memory_per_gpu, moe_parameter_count, predict_moe, rank_expert_parallel)
from mpu_lab.perf.cost_model.optimizer_state import (  # noqa: F401
    bytes_per_parameter, bytes_per_parameter_terms, canonical_dtype,
    format_bytes_per_parameter)
from mpu_lab.perf.cost_model.predict import (  # noqa: F401
    ADAM_STEP_BYTES_PER_PARAM, EFFECTS, ELEMENTWISE_PASSES, IterationPrediction,
    group_crosses_nodes, predict_iteration)

__all__ = [
    "activation_memory_per_layer", "ModelShape", "ParallelConfig", "Cluster",
    "DGX_A100_80GB", "DGX_H100", "CLUSTERS", "RECOMPUTE_MODES", "SCHEDULES",
    "GPT2_SMALL", "GPT3_175B", "MODELS", "group_crosses_nodes",
    "parameter_count", "parameters_per_gpu", "model_flops_per_iteration",
    "hardware_flops_per_iteration", "flops_per_token", "bubble_fraction",
    "ring_all_reduce_factor", "tp_comm_per_layer", "pipeline_p2p_bytes",
    "dp_allreduce_bytes", "in_flight_microbatches", "memory_per_gpu",
    "IterationPrediction", "predict_iteration", "EFFECTS",
    "bytes_per_parameter", "bytes_per_parameter_terms", "format_bytes_per_parameter",
    "CP_COMM_TYPES", "ContextParallelPrediction", "cp_activation_memory_per_layer",
    "cp_comm_bytes_per_layer", "cp_memory_per_gpu", "predict_context_parallel",
    "rank_context_parallel", "ring_overlap",
    "MIXTRAL_8X7B", "MoEModelShape", "MoEPrediction", "moe_a2a_bytes_per_layer",
    "moe_flops_per_token", "moe_memory_per_gpu", "moe_parameter_count", "predict_moe",
    "rank_expert_parallel",
]
