"""Pipeline (inter-layer) model parallelism after Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", §2.2, and Huang et al. 2019, GPipe.

Modules, named after Megatron-core's ``megatron.core.pipeline_parallel``:

* :mod:`~mpu_lab.core.pipeline_parallel.partition` — layers per stage and per virtual stage, number
  of micro-batches, and the checks that run before launch;
* :mod:`~mpu_lab.core.pipeline_parallel.p2p_communication` — ``send_forward``, ``recv_backward``,
  ``send_forward_recv_backward``, ... between neighbouring stages;
* :mod:`~mpu_lab.core.pipeline_parallel.schedules` — ``get_forward_backward_func()``: GPipe, 1F1B,
  interleaved 1F1B, no pipelining, each written out as its loops;
* :mod:`~mpu_lab.core.pipeline_parallel.microbatch_steps` — ``forward_step`` / ``backward_step``:
  one micro-batch through one model chunk, what every schedule runs;
* :mod:`~mpu_lab.core.pipeline_parallel.action_lists` — the zero-bubble schedules (Qi et al.
  2024): ZB-H1, ZB-V and DualPipeV written as one list of F / B / W actions per rank;
* :mod:`~mpu_lab.core.pipeline_parallel.schedule_runtime` — the runtime that executes those
  lists, the backward split into input (B) and weight (W) gradients;
* :mod:`~mpu_lab.core.pipeline_parallel.utils` — the model chunks a schedule runs and the shape of
  the messages between them;
* :mod:`~mpu_lab.core.pipeline_parallel.tied_embeddings` — the embedding shared by the first and the
  last stage (both on rank 0 in a V);

The planner of op orders, the bubble on paper and the toy model a lab pipelines in seconds are
not Megatron's: they live in ``mpu_lab.perf`` (``pipeline_order``, ``pipeline_simulation``,
``pipeline_toy``).
"""
from mpu_lab.core.pipeline_parallel.partition import (
    SCHEDULES, canonical_schedule, check_layers, check_schedule, get_num_microbatches,
    layer_offset, partition_table, stage_layers, validate_pipeline_args,
    virtual_size_from_layers_per_virtual_stage)
from mpu_lab.core.pipeline_parallel.action_lists import (
    ACTION_LIST_SCHEDULES, Action, pipeline_actions, rank_actions)
from mpu_lab.core.pipeline_parallel.schedule_runtime import (
    forward_backward_pipelining_dualpipev, forward_backward_pipelining_with_action_list,
    forward_backward_pipelining_zbv, forward_backward_pipelining_zero_bubble_h1)
from mpu_lab.core.pipeline_parallel.schedules import (
    average_losses_across_microbatches, forward_backward_no_pipelining,
    forward_backward_pipelining_gpipe, forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving, get_forward_backward_func)
from mpu_lab.core.pipeline_parallel.tied_embeddings import (
    allreduce_embedding_grads, shared_embedding_or_output_weight, sync_embedding_weights)
from mpu_lab.core.pipeline_parallel.utils import get_tensor_shape, model_chunks_of, unwrap_model

__all__ = [
    "SCHEDULES", "canonical_schedule", "check_layers", "check_schedule", "get_num_microbatches",
    "layer_offset", "partition_table", "stage_layers", "validate_pipeline_args",
    "virtual_size_from_layers_per_virtual_stage",
    "average_losses_across_microbatches", "forward_backward_no_pipelining",
    "forward_backward_pipelining_gpipe", "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving", "get_forward_backward_func",
    "ACTION_LIST_SCHEDULES", "Action", "pipeline_actions", "rank_actions",
    "forward_backward_pipelining_with_action_list", "forward_backward_pipelining_zbv",
    "forward_backward_pipelining_dualpipev",
    "forward_backward_pipelining_zero_bubble_h1",
    "get_tensor_shape", "model_chunks_of", "unwrap_model",
    "allreduce_embedding_grads", "shared_embedding_or_output_weight", "sync_embedding_weights",
]
