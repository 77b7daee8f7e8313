"""The gradient reductions between backward and the optimizer step (Megatron-core's
``core/distributed/finalize_model_grads.py``): the data-parallel average (over data x
context parallel, Megatron's dp-cp group, with context parallelism) — torch DDP's bucket
all-reduce routed through :mod:`mpu_lab.core.comm` at PP=1 (:func:`ddp_allreduce_hook`),
one coalesced all-reduce after the pipeline schedule at PP > 1 or with experts
(:func:`allreduce_data_parallel_grads`, what Megatron's DDP does in ``finish_grad_sync``; the
expert gradients over the expert-data-parallel group; a missing gradient counts as zeros, as
in Megatron's always-present gradient buffer) —,
the sequence-parallel LayerNorm sums (:func:`allreduce_sequence_parallel_grads`, Megatron's
``_allreduce_layernorm_grads``) and the tied embedding summed over the first and last stage
(:func:`mpu_lab.core.pipeline_parallel.allreduce_embedding_grads`); :func:`finalize_model_grads` runs
them in that order for both train steps."""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from mpu_lab.core import comm, parallel_state
from mpu_lab.core.transformer.moe import is_expert_parameter
from mpu_lab.core.pipeline_parallel import allreduce_embedding_grads


def sequence_parallel_params(model: torch.nn.Module) -> Iterable[torch.nn.Parameter]:
    """Parameters whose gradients are partial sums under sequence parallelism."""
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(model) -> None:
    """All-reduce, over the tensor-parallel group, the gradients of the parameters marked
    ``sequence_parallel`` (LayerNorms, row-parallel biases): Megatron's
    ``_allreduce_layernorm_grads``. One coalesced all-reduce; a no-op without sequence
    parallelism or at TP=1. Call it after backward, before clipping and the optimizer step.
    ``model`` is a module or a list of model chunks (pipeline stages)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    modules = list(model) if isinstance(model, (list, tuple)) else [model]
    params = [p for m in modules for p in sequence_parallel_params(m) if p.grad is not None]
    if not params:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat = comm.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def ddp_allreduce_hook(state, bucket):
    """DDP communication hook: average the bucket over the data-parallel group through
    :mod:`mpu_lab.core.comm`, the one place collectives are called, instead of DDP's own call."""
    group, size = state
    reduced = comm.all_reduce(bucket.buffer(), group=group)
    reduced.div_(size)
    fut = torch.futures.Future()
    fut.set_result(reduced)
    return fut


def _average_coalesced(params: Sequence[torch.nn.Parameter], group, divisor: int) -> None:
    """Sum the gradients of ``params`` over ``group`` in one flat all-reduce, then divide by
    ``divisor``: the data-parallel average where no DDP reduces the gradients (PP > 1 or
    experts without Megatron's DDP, a lone MoE layer).

    A missing gradient (``.grad is None``: the parameter took no part in this rank's backward)
    counts as **zeros**, and the parameter leaves with a gradient (the average of the other
    ranks' ones, or zeros), at any group size. That is Megatron's rule: its DDP gradient buffer
    always exists, so a parameter that got no gradient contributes the zeros of its slice, and
    the optimizer steps it like any other. It is also the only rule a coalesced collective can
    keep: every rank must send the same elements in the same order, whatever it computed."""
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if comm.group_size(group) == 1 and divisor == 1:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if comm.group_size(group) > 1:
        flat = comm.all_reduce(flat, group=group)
    flat.div_(divisor)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def allreduce_data_parallel_grads(params: Sequence[torch.nn.Parameter]) -> None:
    """Average the gradients over the data x context parallel group (Megatron's dp-cp group:
    context-parallel ranks hold the same weights and other tokens) in one coalesced
    all-reduce: what DDP does at PP=1, done once after the pipeline schedule, and with experts
    (no DDP); a missing gradient counts as zeros (:func:`_average_coalesced`).

    Expert parameters (mixture of experts, marked ``allreduce = False``) are summed over the
    *expert*-data-parallel group instead — the ranks that hold the same experts — and divided
    by the same dense size ``d`` (Megatron's DDP: its ``expert_gradient_scaling_factor`` is
    its ``gradient_scaling_factor``, ``1 / d``). Why ``d`` for the experts too: the loss is the
    mean over the ``d`` replicas' batches, and the gradient an expert collects during backward
    already holds every token of its expert-parallel group routed to it; the sum over the
    expert replicas then holds every token of the global batch once, and ``1/d`` makes it the
    mean's gradient."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    size = comm.group_size(group)
    dense = [p for p in params if not is_expert_parameter(p)]
    experts = [p for p in params if is_expert_parameter(p)]
    _average_coalesced(dense, group, size)
    if experts:
        _average_coalesced(experts, parallel_state.get_expert_data_parallel_group(), size)


def finalize_model_grads(model, data_parallel_params: Optional[Sequence[torch.nn.Parameter]] = None,
                         ddp_chunks: Sequence = ()) -> None:
    """Megatron-core's ``finalize_model_grads``. ``model``:
    the model, or this rank's list of pipeline chunks. ``data_parallel_params`` given (PP > 1,
    no DDP): their gradients are first averaged over the data-parallel group; at PP=1 DDP has
    done that during backward. Then the sequence-parallel sums, then the tied embedding over
    the embedding group (a no-op with one pipeline stage).

    ``ddp_chunks`` (Megatron's data parallelism, :mod:`mpu_lab.training.setup`): their buckets are
    finished first (those started during backward waited for, the others run), then the
    model-parallel sums, then the late buckets: the gradients the model-parallel sums touch
    are reduced over the data-parallel group only after them. A sum is linear, so the order
    does not change an all-reduced gradient; it matters for the distributed optimizer, whose
    reduce-scatter leaves each rank the average of its own shard only."""
    for ddp in ddp_chunks:
        ddp.finish_grad_sync()
    if data_parallel_params is not None:
        allreduce_data_parallel_grads(data_parallel_params)
    allreduce_sequence_parallel_grads(model)
    allreduce_embedding_grads(model)
    for ddp in ddp_chunks:
        ddp.finish_grad_sync(late=True)
