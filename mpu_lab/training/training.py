"""The training loop (Megatron's ``megatron/training/training.py``): :func:`train_step` — the
micro-batches' forward and backward passes (gradient accumulation; DDP all-reduces during the
last one), the gradient reductions, fp16 loss-scale check, TP-aware clipping and the optimizer
step — or, with ``--pipeline-model-parallel-size`` > 1, :func:`train_step_pipelined`, where the
micro-batches go through the stages under
:func:`~mpu_lab.core.pipeline_parallel.get_forward_backward_func` (GPipe, 1F1B or interleaved) with
:func:`forward_step`; both reduce the loss with :func:`loss_across_context_parallel_ranks`
(:func:`masked_mean_loss`, over the context-parallel ranks' shares of the tokens) and
:func:`average_losses_across_data_parallel_group` and return :func:`_step_output`'s dict.
:func:`train` is the loop, logging JSON lines (``--metrics-file``) and saving checkpoints;
:func:`pretrain` parses, validates, sets up and trains. Mixed precision is ``torch.autocast``
over fp32 parameters.

Code from outside enters the loop at fixed points only, as Megatron's loop calls its
``timers`` and ``process_non_loss_data_func``: the :class:`Callback` objects passed to
:func:`train` (and :func:`train_step`) are called before a step, before its optimizer step and
after its loss average; :func:`train` hands ``storage_writer`` (a
``torch.distributed.checkpoint`` ``StorageWriter``) to every checkpoint save."""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import pathlib
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from mpu_lab.training import checkpointing, initialize
from mpu_lab.core import comm, parallel_state
from mpu_lab.core.optimizer import DistributedOptimizer, clip_grad_norm
from mpu_lab.core.distributed.fsdp import FullyShardedOptimizer
from mpu_lab.training.resident_bytes import RESIDENT_KEYS, resident_bytes
from mpu_lab.core.pipeline_parallel import (
    average_losses_across_microbatches, get_forward_backward_func, unwrap_model)
from mpu_lab.core.pipeline_parallel.partition import V_SCHEDULES, canonical_schedule
from mpu_lab.training.checkpointing import gather_model_state_dict
from mpu_lab.training.plain_gpt import PlainGPT
from mpu_lab.core.transformer.moe import MoEAuxLossAutoScaler
from mpu_lab.training.arguments import model_config, parse_args, validate_args
from mpu_lab.training.dense_twin import train_dense_twin
from mpu_lab.core.distributed.finalize_model_grads import finalize_model_grads
from mpu_lab.training.setup import TrainState, get_batch, has_experts, setup
from mpu_lab.training.moe_metrics import load_balancing_loss


class Callback:
    """A hook on the training loop. :func:`train_step` calls each callback of its
    ``callbacks`` list, in list order, at three fixed points; every method here does nothing,
    a subclass overrides the ones it needs (e.g. :class:`mpu_lab.perf.breakdown.StepTimer`).

    * ``on_step_begin(state)``: before the step's first forward; ``state.iteration`` counts
      the steps done so far.
    * ``on_before_optimizer_step(state)``: after the backward of every micro-batch and the
      gradient reductions (``finalize_model_grads``), before the fp16 unscale, the clipping and
      the optimizer step.
    * ``on_step_end(state, step)``: after the loss average over the data-parallel group;
      ``step`` is the dict :func:`train_step` returns, and ``state.iteration`` counts this step.
    * ``on_pipeline_action(kind, microbatch, chunk)``: with pipeline parallelism, as the
      schedule starts each action (``F``, ``B``, ``W``, or ``BW`` for an unsplit backward;
      the schedules' ``action_callback``).
    """

    def on_step_begin(self, state: TrainState) -> None:
        pass

    def on_before_optimizer_step(self, state: TrainState) -> None:
        pass

    def on_step_end(self, state: TrainState, step: Dict[str, float]) -> None:
        pass

    def on_pipeline_action(self, kind: str, microbatch: int, chunk: int) -> None:
        pass


def masked_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss: the mean of the per-token loss over ``loss_mask``, in fp32 (both
    train steps; the pipeline schedule's ``loss_func``)."""
    return (per_token_loss.float() * loss_mask).sum() / loss_mask.sum()


def loss_across_context_parallel_ranks(per_token_loss: torch.Tensor, loss_mask: torch.Tensor
                                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(loss to backpropagate, loss to report)`` of a micro-batch whose tokens the
    context-parallel ranks share (Megatron's ``loss_func`` in ``pretrain_gpt.py``).

    Each CP rank holds ``s/cp`` of the tokens: the sums of the masked per-token losses and of
    the mask, all-reduced over the CP group, give the micro-batch's mean over ``loss_mask``
    (reported). This rank backpropagates its own sum over the whole count, times ``cp``: the
    gradients are then averaged over data x context parallel, so the ``cp`` parts add up to
    the gradient of the micro-batch's mean. With cp = 1 both are :func:`masked_mean_loss`.
    """
    cp_group = parallel_state.get_context_parallel_group()
    cp = comm.group_size(cp_group)
    if cp == 1:
        loss = masked_mean_loss(per_token_loss, loss_mask)
        return loss, loss.detach()
    local = (per_token_loss.float() * loss_mask).sum()
    sums = comm.all_reduce(torch.stack([local.detach(), loss_mask.sum().float()]), group=cp_group)
    return local * cp / sums[1], sums[0] / sums[1]


def average_losses_across_data_parallel_group(loss: torch.Tensor) -> torch.Tensor:
    """The global batch's loss from this replica's mean over its micro-batches: the mean over
    the data-parallel group (Megatron's function of this name, in ``training/utils.py``)."""
    dp_group = parallel_state.get_data_parallel_group()
    if comm.group_size(dp_group) > 1:
        loss = comm.all_reduce(loss, group=dp_group) / comm.group_size(dp_group)
    return loss


def _step_output(state: TrainState, loss, grad_norm: float, lr: float, skipped: bool
                 ) -> Dict[str, float]:
    """What a train step returns (and :func:`train` logs)."""
    out = dict(lm_loss=float(loss), grad_norm=grad_norm, lr=lr, skipped=skipped)
    if state.scaler:
        out["loss_scale"] = state.scaler.scale
    out.update(resident_bytes(state))   # after optimizer.step(), before the next zero_grad
    return out


def _loss_scale(state: TrainState) -> float:
    """The factor this step's loss is multiplied by before backward: the fp16 loss scale
    (1 without ``--fp16``)."""
    return state.scaler.scale if state.scaler else 1.0


def _autocast(args, device):
    if args.bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if args.fp16:
        return torch.autocast(device_type=device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def _optimizer_step(args, state, params):
    """Unscale (fp16), clip over the model-parallel group, step, advance the schedule. With
    the distributed optimizer the gradients are this rank's shards, so the overflow check and
    the norm go over every rank (data x model parallel), as Megatron's grad-stats group.

    Returns ``(lr, grad_norm, skipped)``; ``grad_norm`` is NaN when fp16 overflow skipped
    the step.
    """
    mp_group = parallel_state.get_model_parallel_group()
    # experts: their squares summed over the ranks that hold the other experts and slices
    # (Megatron's expert tp-ep-pp group), the dense ones over the model-parallel group
    expert_group = parallel_state.get_expert_tensor_model_pipeline_parallel_group() \
        if has_experts(args) else None
    if isinstance(state.optimizer, (DistributedOptimizer, FullyShardedOptimizer)):
        # every rank's shards are distinct (experts included): one sum over the world
        params, mp_group, expert_group = state.optimizer.shard_params, dist.group.WORLD, None
    skipped = False
    if state.scaler:
        skipped = state.scaler.unscale_and_check(params, mp_group)
        state.scaler.update(skipped)
    lr = state.scheduler.lr_for_next_step()
    grad_norm = float("nan")
    if not skipped:
        grad_norm = clip_grad_norm(params, args.clip_grad, mp_group, expert_group)
        state.optimizer.step()
        state.scheduler.step()   # as Megatron's train_step: only after a successful update
    else:
        state.skipped_iterations += 1
    state.iteration += 1
    return lr, grad_norm, skipped


def _set_aux_loss_scale(state: TrainState, device) -> None:
    """The gradient the MoE load-balancing losses get in backward (Megatron's
    ``MoEAuxLossAutoScaler.set_loss_scale``): the main loss's factor, loss scale / M."""
    if has_experts(state.args):
        scale = _loss_scale(state) / state.args.num_micro_batches
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale, device=device))


def _zero_grads(state: TrainState) -> None:
    """Before a step: the optimizer's gradients, and Megatron-DDP's gradient buffers (which
    point each ``.grad`` back at its slice of the buffer)."""
    state.optimizer.zero_grad(set_to_none=True)
    for ddp in state.ddp_chunks:
        ddp.zero_grad_buffer()


def train_step(state: TrainState, callbacks: Sequence[Callback] = ()) -> Dict[str, float]:
    """One iteration (``state.iteration`` is 0-based on entry, incremented on exit), calling
    ``callbacks`` at their points (:class:`Callback`)."""
    if state.args.pipeline_model_parallel_size > 1:
        return train_step_pipelined(state, callbacks)
    for callback in callbacks:
        callback.on_step_begin(state)
    args, model, ddp_model = state.args, state.model, state.ddp_model
    device = initialize.get_device()
    model.train()
    _zero_grads(state)
    _set_aux_loss_scale(state, device)
    M = args.num_micro_batches
    scale = _loss_scale(state)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    for m in range(M):
        batch = get_batch(state, state.iteration, m)
        sync = contextlib.nullcontext()
        if isinstance(ddp_model, DDP) and m < M - 1:
            sync = ddp_model.no_sync()   # accumulate locally; all-reduce on the last micro-batch
        with sync:
            with _autocast(args, device):
                losses = ddp_model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
            # mean over this micro-batch (its tokens on every CP rank)
            loss, reported = loss_across_context_parallel_ranks(losses, batch["loss_mask"])
            (loss * (scale / M)).backward()
        loss_sum += reported
    params = [p for p in model.parameters() if p.requires_grad]
    # with experts and no Megatron-DDP (no torch DDP either): dense and expert gradients are
    # averaged here, each over its group
    plain_experts = has_experts(args) and not state.ddp_chunks
    finalize_model_grads(model, data_parallel_params=params if plain_experts else None,
                         ddp_chunks=state.ddp_chunks)
    for callback in callbacks:
        callback.on_before_optimizer_step(state)
    lr, grad_norm, skipped = _optimizer_step(args, state, params)
    # Loss of the global batch: mean over micro-batches, then over the data-parallel group.
    loss = average_losses_across_data_parallel_group(loss_sum / M)
    step = _step_output(state, loss, grad_norm, lr, skipped)
    for callback in callbacks:
        callback.on_step_end(state, step)
    return step


def _microbatches(state: TrainState, iteration: int, chunk) -> Iterator[Optional[Dict[str, torch.Tensor]]]:
    """One chunk's data iterator for one iteration: a micro-batch for each forward. Only the
    chunks with the embedding (tokens) or the loss (labels, mask) read data; the others get
    ``None`` (Megatron's ``get_batch`` on middle stages)."""
    needs_data = chunk.pre_process or chunk.post_process
    for m in range(state.args.num_micro_batches):
        yield get_batch(state, iteration, m) if needs_data else None


def forward_step(state: TrainState, data_iterator, model):
    """Megatron's ``forward_step_func`` for the pipeline schedules: one micro-batch through
    one model chunk; returns ``(output_tensor, loss_func)``. The first stage feeds tokens, the
    last one labels; ``loss_func`` turns the per-token loss into this micro-batch's mean over
    ``loss_mask`` (the schedule divides by the number of micro-batches)."""
    batch = next(data_iterator)
    chunk = unwrap_model(model)
    labels = batch["labels"] if chunk.post_process else None
    with _autocast(state.args, initialize.get_device()):
        if chunk.pre_process:
            output = model(batch["tokens"], batch["position_ids"], labels=labels)
        else:
            output = model(labels=labels)   # input from set_input_tensor

    def loss_func(per_token_loss):
        loss, reported = loss_across_context_parallel_ranks(per_token_loss, batch["loss_mask"])
        return loss, {"lm_loss": reported}

    return output, loss_func


def train_step_pipelined(state: TrainState, callbacks: Sequence[Callback] = ()
                         ) -> Dict[str, float]:
    """One iteration with pipeline parallelism (Megatron's ``train_step`` with
    ``get_forward_backward_func()``): the schedule runs the forwards and backwards of all
    micro-batches over the stages; then the gradients are finished — data-parallel average,
    sequence-parallel LayerNorm sums, the tied embedding summed over the first and last stage
    — clipped over the model-parallel group and applied. The loss lives on the last stage; it
    is broadcast over the pipeline so every rank returns it. ``callbacks`` as in
    :func:`train_step`."""
    for callback in callbacks:
        callback.on_step_begin(state)
    args, chunks = state.args, state.model_chunks
    device = initialize.get_device()
    for chunk in chunks:
        chunk.train()
    _zero_grads(state)
    _set_aux_loss_scale(state, device)
    scale = _loss_scale(state)
    iterators = [_microbatches(state, state.iteration, chunk) for chunk in chunks]
    forward_backward = get_forward_backward_func(args.pipeline_schedule)
    store = forward_backward(
        forward_step_func=functools.partial(forward_step, state),
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        # each context-parallel rank sends and receives its s/cp tokens between stages
        num_microbatches=args.num_micro_batches,
        seq_length=args.seq_length // getattr(args, "context_parallel_size", 1),
        micro_batch_size=args.micro_batch_size, forward_only=False,
        grad_scale_func=(lambda loss: loss * scale) if state.scaler else None,
        action_callback=lambda *action: [c.on_pipeline_action(*action) for c in callbacks
                                         if hasattr(c, "on_pipeline_action")])
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    finalize_model_grads(chunks, data_parallel_params=None if state.ddp_chunks else params,
                         ddp_chunks=state.ddp_chunks)
    for callback in callbacks:
        callback.on_before_optimizer_step(state)
    lr, grad_norm, skipped = _optimizer_step(args, state, params)
    # The loss of the global batch: on the last stage the mean over micro-batches, averaged
    # over the data-parallel group; then sent from the last stage to the whole pipeline.
    loss = torch.zeros((), dtype=torch.float32, device=device)
    # The last stage is on the last pipeline rank, or on the first in a V (ZBVZeroBubble).
    in_v = canonical_schedule(args.pipeline_schedule) in V_SCHEDULES
    if any(unwrap_model(chunk).post_process for chunk in chunks):
        loss += average_losses_across_microbatches(store)["lm_loss"]
        loss = average_losses_across_data_parallel_group(loss)
    loss = comm.broadcast(loss, src=parallel_state.get_pipeline_model_parallel_first_rank() if in_v
                          else parallel_state.get_pipeline_model_parallel_last_rank(),
                          group=parallel_state.get_pipeline_model_parallel_group())
    step = _step_output(state, loss, grad_norm, lr, skipped)
    for callback in callbacks:
        callback.on_step_end(state, step)
    return step


def train(state: TrainState, train_iters: Optional[int] = None,
          log: Callable[[str], None] = print, callbacks: Sequence[Callback] = (),
          storage_writer=None) -> List[Dict[str, Any]]:
    """Run to ``train_iters`` (default ``args.train_iters``) optimizer steps; return the
    metrics of each logged iteration (the same dicts as the ``--metrics-file`` lines, appended
    to that file, whose folder is made if missing). ``callbacks`` go to every
    :func:`train_step`; ``storage_writer`` to every
    :func:`~mpu_lab.training.checkpointing.save_checkpoint` (None: DCP's file writer)."""
    args = state.args
    end = args.train_iters if train_iters is None else train_iters
    device = initialize.get_device()
    rank0 = dist.get_rank() == 0
    metrics_out = None
    if args.metrics_file and rank0:
        pathlib.Path(args.metrics_file).parent.mkdir(parents=True, exist_ok=True)
        metrics_out = open(args.metrics_file, "a")
    tokens_per_iteration = args.global_batch_size * args.seq_length
    logged: List[Dict[str, Any]] = []
    window_losses, window_start = [], None
    try:
        initialize.synchronize(device)
        window_start = time.perf_counter()
        while state.iteration < end:
            step = train_step(state, callbacks)
            window_losses.append(step["lm_loss"])
            it = state.iteration
            if it % args.log_interval == 0 or it == end:
                initialize.synchronize(device)
                now = time.perf_counter()
                dt = (now - window_start) / len(window_losses)
                record = dict(iteration=it, lm_loss=sum(window_losses) / len(window_losses),
                              grad_norm=step["grad_norm"], lr=step["lr"], iteration_time_s=dt,
                              tokens_per_s=tokens_per_iteration / dt,
                              consumed_samples=it * args.global_batch_size,
                              skipped_iterations=state.skipped_iterations,
                              skipped_iter=bool(step["skipped"]))
                if "loss_scale" in step:
                    record["loss_scale"] = step["loss_scale"]
                record.update({k: step[k] for k in RESIDENT_KEYS if k in step})
                if has_experts(args) and args.moe_aux_loss_coeff > 0:
                    record["load_balancing_loss"] = load_balancing_loss(state.model_chunks)
                logged.append(record)
                if metrics_out:
                    metrics_out.write(json.dumps(record) + "\n")
                    metrics_out.flush()
                if rank0 and not args.quiet:
                    log(f" iteration {it:8d}/{end:8d} | consumed samples: {record['consumed_samples']:9d}"
                        f" | elapsed time per iteration (ms): {dt * 1e3:8.1f} | learning rate: "
                        f"{step['lr']:.3E} | lm loss: {record['lm_loss']:.6E} | grad norm: "
                        f"{step['grad_norm']:.3f} | tokens/s: {record['tokens_per_s']:.0f}")
                window_losses = []
                window_start = time.perf_counter()
            if args.save and args.save_interval and it % args.save_interval == 0:
                checkpointing.save_checkpoint(args.save, state, storage_writer)
                window_start = time.perf_counter()
        if args.save and not (args.save_interval and state.iteration % args.save_interval == 0):
            checkpointing.save_checkpoint(args.save, state, storage_writer)
    finally:
        if metrics_out:
            metrics_out.close()
    return logged


def dense_twin_weights(state: TrainState) -> Optional[Dict[str, torch.Tensor]]:
    """The run's full TP=1 weights, on global rank 0 (None on the others): collective over
    the tensor- and pipeline-parallel groups, so every rank calls it (before training, for
    the twin to start where the run starts)."""
    pipeline = state.args.pipeline_model_parallel_size > 1
    weights = gather_model_state_dict(state.model_chunks if pipeline else state.model,
                                      pipeline=pipeline)
    return weights if dist.get_rank() == 0 else None


def dense_twin_losses(args: argparse.Namespace, weights: Dict[str, torch.Tensor],
                      iterations: Optional[int] = None) -> List[float]:
    """The per-iteration losses of the run's dense twin: a
    :class:`~mpu_lab.training.plain_gpt.PlainGPT` holding ``weights`` (:func:`dense_twin_weights`),
    trained in this process like the run (:func:`~mpu_lab.training.dense_twin.train_dense_twin`);
    what a run's logged losses are compared with (``--dense-twin``)."""
    twin = PlainGPT.from_config(model_config(args), args.padded_vocab_size,
                                args.max_position_embeddings)
    twin.load_state_dict(weights)
    return train_dense_twin(args, twin, args.train_iters if iterations is None else iterations)


def pretrain(argv: Optional[Sequence[str]] = None, args: Optional[argparse.Namespace] = None,
             log: Callable[[str], None] = print, callbacks: Sequence[Callback] = (),
             storage_writer=None):
    """Parse, validate, set up and train in a process that ``torch.distributed`` already runs
    in (a torchrun worker; groups are (re)initialised from the flags); ``callbacks`` and
    ``storage_writer`` as in :func:`train`. Returns ``(metrics, state)``."""
    if args is None:
        args = parse_args(argv)
    validate_args(args, dist.get_world_size())
    state = setup(args, log=log)
    return train(state, log=log, callbacks=callbacks, storage_writer=storage_writer), state
