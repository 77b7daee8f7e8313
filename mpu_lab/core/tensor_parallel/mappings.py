"""The conjugate communication operators of tensor parallelism, as autograd Functions.

Shoeybi et al. 2019 (Megatron-LM, §3, Fig. 3) split a transformer MLP as ``Y = GeLU(X A)``
with ``A`` split by columns and ``Z = Y B`` with ``B`` split by rows, and need two operators:

* ``f`` = :func:`copy_to_tensor_model_parallel_region`: identity forward, all-reduce backward
  (every rank read the same ``X``, so the gradients of ``X`` from all ranks add up);
* ``g`` = :func:`reduce_from_tensor_model_parallel_region`: all-reduce forward (the partial
  products ``Y_i B_i`` add up to ``Z``), identity backward.

``scatter``/``gather`` move between a full last dimension and this rank's slice of it.

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", §4.2.2) replaces ``f`` by an all-gather along the sequence (``g``-bar
forward: :func:`gather_from_sequence_parallel_region`) and ``g`` by a reduce-scatter along the
sequence (:func:`reduce_scatter_to_sequence_parallel_region`): the same bytes as one
all-reduce, but the activations outside the tensor-parallel block are split along the
sequence. Sequence-parallel tensors are sequence-first, ``[s, b, h]``, so "the sequence" is
dimension 0.

As in Megatron-core, every operator takes ``group=`` (default: the tensor-parallel group), kept
in ``ctx.group`` for ``backward``; a group of one rank communicates nothing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mpu_lab.core import comm, parallel_state
from mpu_lab.core.tensor_parallel.utils import divide, split_tensor_along_last_dim


def _reduce(input_, group):
    """All-reduce (sum) over ``group``."""
    if comm.group_size(group) == 1:
        return input_
    return comm.all_reduce(input_, group=group)


def _split_along_last_dim(input_, group):
    """Keep this rank's slice of the last dimension."""
    if comm.group_size(group) == 1:
        return input_
    pieces = split_tensor_along_last_dim(input_, comm.group_size(group))
    return pieces[dist.get_rank(group=group)].contiguous()


def _split_along_first_dim(input_, group):
    """Keep this rank's block of dimension 0 (the sequence, for ``[s, b, h]`` tensors)."""
    if comm.group_size(group) == 1:
        return input_
    local = divide(input_.size(0), comm.group_size(group))
    rank = dist.get_rank(group=group)
    return input_[rank * local:(rank + 1) * local].contiguous()


def _gather_along_last_dim(input_, group):
    """Concatenate every rank's tensor along the last dimension, in group-rank order."""
    if comm.group_size(group) == 1:
        return input_
    return comm.all_gather(input_, group=group, dim=input_.dim() - 1)


def _gather_along_first_dim(input_, group):
    """Concatenate every rank's tensor along dimension 0, in group-rank order."""
    if comm.group_size(group) == 1:
        return input_
    return comm.all_gather(input_, group=group, dim=0)


def _reduce_scatter_along_first_dim(input_, group):
    """Sum over ``group`` and keep this rank's block of dimension 0."""
    if comm.group_size(group) == 1:
        return input_
    return comm.reduce_scatter(input_, group=group, dim=0)


# --------------------------------------------------------------------------- tensor parallel
class _CopyToModelParallelRegion(torch.autograd.Function):
    """``f`` of Megatron-LM §3: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """``g`` of Megatron-LM §3: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, input_, group):
        return _reduce(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dimension; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output, ctx.group), None


# --------------------------------------------------------------------------- sequence parallel
class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's block of the sequence (dim 0); backward all-gathers it."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence (dim 0): ``g``-bar of Korthikanti et al. §4.2.2, entering a
    tensor-parallel block.

    Backward: when the consumer is tensor-parallel (``tensor_parallel_output_grad=True``, the
    usual case: a column-parallel linear) every rank holds only a partial gradient of the
    full sequence, so the gradients are summed *and* split — one reduce-scatter. Otherwise the
    gradient is already complete on every rank and each rank just keeps its block.
    """

    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad, group):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad_output, ctx.group), None, None
        return _split_along_first_dim(grad_output, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Sum over the group and keep this rank's block of the sequence (dim 0): ``g`` of
    Korthikanti et al. §4.2.2, leaving a tensor-parallel block. Backward all-gathers."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


# --------------------------------------------------------------------------- public functions
def _tp_group(group):
    return group if group is not None else parallel_state.get_tensor_model_parallel_group()


def copy_to_tensor_model_parallel_region(input_, group=None):
    """``f``: identity forward, all-reduce backward (enter a tensor-parallel region)."""
    return _CopyToModelParallelRegion.apply(input_, _tp_group(group))


def reduce_from_tensor_model_parallel_region(input_, group=None):
    """``g``: all-reduce forward, identity backward (leave a tensor-parallel region)."""
    return _ReduceFromModelParallelRegion.apply(input_, _tp_group(group))


def scatter_to_tensor_model_parallel_region(input_, group=None):
    """Split the last dimension, keep this rank's slice; backward all-gathers."""
    return _ScatterToModelParallelRegion.apply(input_, _tp_group(group))


def gather_from_tensor_model_parallel_region(input_, group=None):
    """All-gather the last dimension; backward keeps this rank's slice."""
    return _GatherFromModelParallelRegion.apply(input_, _tp_group(group))


def scatter_to_sequence_parallel_region(input_, group=None):
    """Split dim 0 (the sequence of ``[s, b, h]``), keep this rank's block; backward all-gathers."""
    return _ScatterToSequenceParallelRegion.apply(input_, _tp_group(group))


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None):
    """All-gather dim 0; backward reduce-scatters (or only splits when
    ``tensor_parallel_output_grad=False``)."""
    return _GatherFromSequenceParallelRegion.apply(input_, tensor_parallel_output_grad,
                                                   _tp_group(group))


def reduce_scatter_to_sequence_parallel_region(input_, group=None):
    """Reduce-scatter dim 0; backward all-gathers."""
    return _ReduceScatterToSequenceParallelRegion.apply(input_, _tp_group(group))
