"""Setting a run up (Megatron's ``megatron/training/training.py`` ``get_model`` and
``setup_model_and_optimizer``, and ``get_batch`` of ``pretrain_gpt.py``): :class:`TrainState`,
what a run carries from step to step; :func:`get_model`, this rank's part of the GPT;
:func:`setup`, which initialises the groups and seeds, wraps the model in DDP over the
data x context parallel group at PP=1 (its bucket all-reduces routed through
:func:`~mpu_lab.core.distributed.finalize_model_grads.ddp_allreduce_hook`), builds AdamW, the
learning-rate schedule and the data and loads a checkpoint; :func:`get_batch`, a
micro-batch read by tensor-parallel rank 0 and broadcast to its group, then cut to this
context-parallel rank's chunks."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from mpu_lab.training import checkpointing, datasets, initialize
from mpu_lab.core import parallel_state
from mpu_lab.core.context_parallel import get_batch_on_this_cp_rank
from mpu_lab.core.distributed.distributed_data_parallel import DistributedDataParallel
from mpu_lab.core.distributed.fsdp import (FullyShardedDataParallel, FullyShardedOptimizer,
                                           unsharded_parameters)
from mpu_lab.core.transformer.moe import is_expert_parameter
from mpu_lab.core.distributed.finalize_model_grads import sequence_parallel_params
from mpu_lab.core.optimizer import DistributedOptimizer, DynamicGradScaler, build_optimizer
from mpu_lab.core.pipeline_parallel import (
    model_chunks_of, shared_embedding_or_output_weight, sync_embedding_weights)
from mpu_lab.core.tensor_parallel import broadcast_data, model_parallel_manual_seed
from mpu_lab.training.arguments import model_config, vocab_padding_message
from mpu_lab.training.fsdp_args import sharding_strategy
from mpu_lab.core.distributed.finalize_model_grads import ddp_allreduce_hook
from mpu_lab.training.optimizer_param_scheduler import OptimizerParamScheduler, build_scheduler
from mpu_lab.training.pipeline_v_chunks import build_model_chunks_for_schedule


@dataclasses.dataclass
class TrainState:
    args: argparse.Namespace
    model: torch.nn.Module            # the GPTModel (PP > 1: this rank's stage; a ModuleList of
                                      # its chunks with virtual stages)
    ddp_model: torch.nn.Module        # what forward goes through (DDP, or the model at DP=1)
    optimizer: torch.optim.Optimizer
    scheduler: OptimizerParamScheduler
    dataset: Any
    iteration: int = 0               # optimizer steps done
    scaler: Optional[DynamicGradScaler] = None
    skipped_iterations: int = 0
    model_chunks: List[torch.nn.Module] = dataclasses.field(default_factory=list)
    # Megatron's data parallelism (mpu_lab.core.distributed.DistributedDataParallel), one per chunk,
    # with --use-distributed-optimizer or --overlap-grad-reduce; empty on the torch-DDP path
    ddp_chunks: List[DistributedDataParallel] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.model_chunks:
            self.model_chunks = model_chunks_of(self.model)


def get_model(args: argparse.Namespace) -> torch.nn.Module:
    """This rank's part of the GPT (Megatron's ``get_model``): the whole
    :class:`~mpu_lab.core.models.gpt.GPTModel` at PP=1; at PP > 1 its pipeline stage, or a
    ``ModuleList`` of its ``v`` chunks with virtual stages, holding the same weights as the
    PP=1 model (:func:`~mpu_lab.core.models.gpt.build_model_chunks`), the tied embedding copies made
    equal over the embedding group. Groups and seeds must be set."""
    chunks = build_model_chunks_for_schedule(   # ZBVZeroBubble, DualPipeV: two chunks in a V
        model_config(args), args.padded_vocab_size, args.max_position_embeddings,
        getattr(args, "pipeline_schedule", None))
    if args.pipeline_model_parallel_size > 1:
        sync_embedding_weights(chunks)
    return chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)


def setup(args: argparse.Namespace, log: Callable[[str], None] = print) -> TrainState:
    """Groups, seeds, model, DDP, optimizer, schedule, data; loads ``args.load`` if given.
    ``args`` must have been through :func:`validate_args`. ``torch.distributed`` must be up."""
    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        context_parallel_size=getattr(args, "context_parallel_size", 1),
        virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None),
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None))
    model_parallel_manual_seed(args.seed)
    device = initialize.get_device()
    model = get_model(args)
    ddp_model = model
    # The gradients of the weights are averaged over data x context parallel (Megatron's dp-cp
    # group): CP ranks hold the same weights and different tokens of the same samples.
    dp_cp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    # Data parallelism: torch DDP at PP=1. At PP > 1 the schedule interleaves the backwards of
    # many micro-batches (and chunks) with p2p messages; DDP would all-reduce during the last
    # micro-batch's backward, which under 1F1B is not the last backward to run. So there the
    # gradients are all-reduced explicitly over the data-parallel group once per step, after
    # the schedule (allreduce_data_parallel_grads), as Megatron's own DDP does in
    # finish_grad_sync.
    ddp_chunks: List[DistributedDataParallel] = []
    if sharding_strategy(args):     # --use-megatron-fsdp (PP=1, no experts)
        ddp_chunks = wrap_megatron_fsdp(model, args)
    elif getattr(args, "use_distributed_optimizer", False) or getattr(args, "overlap_grad_reduce", False):
        ddp_chunks = wrap_megatron_ddp(model_chunks_of(model), args)
    elif dp_cp > 1 and args.pipeline_model_parallel_size == 1 and not has_experts(args):
        # (with experts no torch DDP: it would average the expert gradients over the dense
        # data-parallel group; train_step reduces them after backward, finalize_model_grads)
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        ddp_model = DDP(model, device_ids=[device] if device.type == "cuda" else None,
                        process_group=group)   # GPTModel has no buffers to sync
        ddp_model.register_comm_hook((group, dp_cp), ddp_allreduce_hook)
    if sharding_strategy(args):
        optimizer = megatron_fsdp_optimizer(ddp_chunks, model, args)
    elif ddp_chunks and args.use_distributed_optimizer:
        optimizer = DistributedOptimizer(ddp_chunks, args)
    else:
        optimizer = build_optimizer(model, args)
    scheduler = build_scheduler(optimizer, args)
    num_samples = args.global_batch_size * max(args.train_iters, 1)
    dataset = datasets.build_dataset(args.data_path, num_samples, args.seq_length,
                                     args.vocab_size, args.seed)
    state = TrainState(args, model, ddp_model, optimizer, scheduler, dataset,
                       scaler=build_grad_scaler(args) if args.fp16 else None,
                       ddp_chunks=ddp_chunks)
    if dist.get_rank() == 0 and args.padded_vocab_size != args.vocab_size:
        log(vocab_padding_message(args))
    if dist.get_rank() == 0 and args.pipeline_model_parallel_size > 1 and not args.quiet:
        log(f"> pipeline schedule: {args.pipeline_schedule}")   # torch's name, any spelling given
    if args.load:
        with unsharded_parameters(ddp_chunks):      # ZeRO-3: whole parameters to load into
            info = checkpointing.load_checkpoint(
                args.load, model, optimizer=None if args.no_load_optim else optimizer,
                scheduler=None if args.no_load_optim else scheduler, load_rng=not args.no_load_rng,
                args=args, grad_scaler=None if args.no_load_optim else state.scaler)
        state.iteration = info["iteration"]
        if dist.get_rank() == 0:
            log(f"> loaded {info['path']} (iteration {info['iteration']}, saved at TP="
                f"{info['tensor_model_parallel_size']} PP={info.get('pipeline_model_parallel_size', 1)}"
                f", now TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size})")
    return state


def build_grad_scaler(args: argparse.Namespace) -> DynamicGradScaler:
    """The fp16 loss scaler as Megatron-LM's ``get_megatron_optimizer`` builds it: growth 2,
    backoff 0.5, the window and the hysteresis from the flags."""
    return DynamicGradScaler(initial_scale=args.initial_loss_scale,
                             min_scale=args.min_loss_scale, growth_factor=2.0,
                             backoff_factor=0.5, growth_interval=args.loss_scale_window,
                             hysteresis=args.hysteresis)


def has_experts(args: argparse.Namespace) -> bool:
    """Whether the model's MLPs are mixture-of-experts layers (``--num-experts``)."""
    return getattr(args, "num_experts", None) is not None


def late_params(chunk: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The parameters of ``chunk`` whose gradients get a model-parallel sum before the
    data-parallel one (Megatron's ``finalize_model_grads`` order): the sequence-parallel
    LayerNorms and biases (summed over the tensor-parallel group) and, with pipeline stages,
    the tied embedding's copy on the first or last stage (summed over the embedding group)."""
    late = list(sequence_parallel_params(chunk)) \
        if parallel_state.get_tensor_model_parallel_world_size() > 1 else []
    if parallel_state.get_pipeline_model_parallel_world_size() > 1 and \
            (getattr(chunk, "pre_process", False) or getattr(chunk, "post_process", False)):
        weight = shared_embedding_or_output_weight(chunk)
        if weight is not None and all(weight is not p for p in late):
            late.append(weight)
    return late


def wrap_megatron_ddp(chunks: List[torch.nn.Module], args: argparse.Namespace
                      ) -> List[DistributedDataParallel]:
    """One :class:`~mpu_lab.core.distributed.distributed_data_parallel.DistributedDataParallel`
    per model chunk over the data x context parallel group (Megatron's dp-cp group: the
    distributed optimizer shards over it too), with buckets of ``--ddp-bucket-size`` elements,
    Megatron's default ``max(40M, 1M x DP x CP)``. The chunks keep running their own forward:
    the wrapper's hooks sit on the parameters.

    With experts (Megatron's separate expert buffer), each chunk gets a second wrapper for its
    expert parameters, over the expert-data-parallel group — the ranks holding the same
    experts; the distributed optimizer shards those over it — their sums scaled by ``1 / d``
    as the dense average (see :func:`mpu_lab.core.distributed.allreduce_data_parallel_grads` for why ``d``)."""
    dp_cp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    size = args.ddp_bucket_size or max(40_000_000, 1_000_000 * dp_cp)
    options = dict(overlap_grad_reduce=args.overlap_grad_reduce,
                   use_distributed_optimizer=args.use_distributed_optimizer, bucket_size=size,
                   num_micro_batches=args.num_micro_batches)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if not has_experts(args):
        return [DistributedDataParallel(chunk, group, late_params=late_params(chunk), **options)
                for chunk in chunks]
    wrapped = []
    for chunk in chunks:
        dense = [p for p in chunk.parameters() if not is_expert_parameter(p)]
        experts = [p for p in chunk.parameters() if is_expert_parameter(p)]
        wrapped.append(DistributedDataParallel(chunk, group, late_params=late_params(chunk),
                                               params=dense, **options))
        wrapped.append(DistributedDataParallel(
            chunk, parallel_state.get_expert_data_parallel_group(), params=experts,
            gradient_scaling_factor=1.0 / dp_cp, **options))
    return wrapped


def wrap_megatron_fsdp(model: torch.nn.Module, args: argparse.Namespace) -> List[torch.nn.Module]:
    """``--use-megatron-fsdp`` (Megatron-LM's ``get_model`` wraps the model in Megatron-core's
    ``FullyShardedDataParallel``), over the data x context parallel group: ``no_shard`` and
    ``optim`` are Megatron's data parallelism (``optim``: reduce-scatter for the distributed
    optimizer), ``optim_grads`` and ``optim_grads_params`` Megatron-FSDP's per-layer units."""
    strategy = sharding_strategy(args)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if strategy in ("optim_grads", "optim_grads_params"):
        return [FullyShardedDataParallel(model, group, strategy)]
    dp_cp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    return [DistributedDataParallel(
        model, group, late_params=late_params(model), overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=strategy == "optim", num_micro_batches=args.num_micro_batches,
        bucket_size=args.ddp_bucket_size or max(40_000_000, 1_000_000 * dp_cp))]


def megatron_fsdp_optimizer(chunks: List[torch.nn.Module], model: torch.nn.Module,
                            args: argparse.Namespace):
    """The optimizer of :func:`wrap_megatron_fsdp`'s ``chunks``: AdamW on every parameter
    (``no_shard``), on this rank's shards (``optim``: the distributed optimizer; the FSDP
    strategies: :class:`~mpu_lab.core.distributed.fsdp.FullyShardedOptimizer`)."""
    strategy = sharding_strategy(args)
    if strategy == "optim":
        return DistributedOptimizer(chunks, args)
    if strategy == "no_shard":
        return build_optimizer(model, args)
    return FullyShardedOptimizer(chunks, args)


def get_batch(state: TrainState, iteration: int, micro_batch: int) -> Dict[str, torch.Tensor]:
    """This rank's micro-batch: read by tensor-parallel rank 0, broadcast to its group
    (Megatron's ``broadcast_data``: the group works on the same tokens); with context
    parallelism, this CP rank's chunks of it (Megatron's ``get_batch_on_this_cp_rank``: tokens,
    labels, loss mask and position ids, ``[b, s/cp]``). The CP ranks of a replica read the same
    samples: the data-parallel rank leaves CP out."""
    args = state.args
    keys = ["tokens", "labels", "position_ids", "loss_mask"]
    data = None
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        ids = datasets.batch_indices(iteration, micro_batch, args.micro_batch_size,
                                     parallel_state.get_data_parallel_rank(),
                                     parallel_state.get_data_parallel_world_size(),
                                     args.num_micro_batches)
        batch = datasets.collate([state.dataset[i] for i in ids])
        batch["loss_mask"] = batch["loss_mask"].long()
        data = batch
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        out = broadcast_data(keys, data, torch.int64)
    else:
        device = initialize.get_device()
        out = {k: data[k].to(device) for k in keys}
    out["loss_mask"] = out["loss_mask"].float()
    return get_batch_on_this_cp_rank(out)
