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

Every operator takes ``group=`` (default: the tensor-parallel group) and is a no-op — it
returns its input — when that group has one rank. All communication goes through
:mod:`mpu_lab.comm`.

Calling ``backward`` directly. Megatron's unit tests call e.g.
``_CopyToModelParallelRegion.backward(None, x)``. With ``ctx=None`` the default group is used
and the gradient tensor is returned alone; autograd (a real ``ctx``) gets the usual tuple with
a ``None`` for each non-tensor argument.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mpu_lab import comm, parallel_state
from mpu_lab.tensor_parallel.utils import divide, split_tensor_along_last_dim


# --------------------------------------------------------------------------- plain helpers
def _tp_group(group=None):
    return group if group is not None else parallel_state.get_tensor_model_parallel_group()


def _ctx_group(ctx):
    # ctx is None (direct call) or a test's stand-in without .group: use the default group.
    return _tp_group(getattr(ctx, "group", None))


def _grad(ctx, grad: torch.Tensor, n_other_args: int):
    """What ``backward`` returns: the tensor alone for a direct call (``ctx is None``), else
    the tensor plus a ``None`` for each non-tensor argument of ``forward``."""
    return grad if ctx is None else (grad,) + (None,) * n_other_args


def _rank_and_size(group):
    return dist.get_rank(group=group), comm.group_size(group)


def _reduce(input_, group):
    """All-reduce (sum) over ``group``."""
    if comm.group_size(group) == 1:
        return input_
    return comm.all_reduce(input_, group=group)


def _split_along_last_dim(input_, group):
    """Keep this rank's slice of the last dimension."""
    rank, size = _rank_and_size(group)
    if size == 1:
        return input_
    return split_tensor_along_last_dim(input_, size)[rank].contiguous()


def _gather_along_last_dim(input_, group):
    """Concatenate every rank's tensor along the last dimension, in group-rank order."""
    if comm.group_size(group) == 1:
        return input_
    return comm.all_gather(input_, group=group, dim=input_.dim() - 1)


def _split_along_first_dim(input_, group):
    """Keep this rank's block of dimension 0 (the sequence, for ``[s, b, h]`` tensors)."""
    rank, size = _rank_and_size(group)
    if size == 1:
        return input_
    local = divide(input_.size(0), size)
    return input_[rank * local:(rank + 1) * local].contiguous()


def _gather_along_first_dim(input_, group):
    """Concatenate every rank's tensor along dimension 0, in group-rank order."""
    if comm.group_size(group) == 1:
        return input_
    return comm.all_gather(input_, group=group, dim=0)


def _reduce_scatter_along_first_dim(input_, group):
    """Sum over ``group`` and keep this rank's block of dimension 0."""
    size = comm.group_size(group)
    if size == 1:
        return input_
    divide(input_.size(0), size)  # a ValueError naming the sizes, before any communication
    return comm.reduce_scatter(input_, group=group, dim=0)


def _reduce_scatter_along_last_dim(input_, group):
    """Sum over ``group`` and keep this rank's slice of the last dimension."""
    size = comm.group_size(group)
    if size == 1:
        return input_
    divide(input_.size(-1), size)
    return comm.reduce_scatter(input_, group=group, dim=input_.dim() - 1)


# --------------------------------------------------------------------------- tensor parallel
class _CopyToModelParallelRegion(torch.autograd.Function):
    """``f`` of Megatron-LM §3: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def symbolic(graph, input_, group=None):
        return input_

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _grad(ctx, _reduce(grad_output, _ctx_group(ctx)), 1)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """``g`` of Megatron-LM §3: all-reduce forward, identity backward."""

    @staticmethod
    def symbolic(graph, input_, group=None):
        return _reduce(input_, _tp_group(group))

    @staticmethod
    def forward(ctx, input_, group=None):
        return _reduce(input_, _tp_group(group))

    @staticmethod
    def backward(ctx, grad_output):
        return _grad(ctx, grad_output, 1)


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dimension; backward all-gathers the gradient."""

    @staticmethod
    def symbolic(graph, input_, group=None):
        return _split_along_last_dim(input_, _tp_group(group))

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _split_along_last_dim(input_, _tp_group(group))

    @staticmethod
    def backward(ctx, grad_output):
        return _grad(ctx, _gather_along_last_dim(grad_output, _ctx_group(ctx)), 1)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def symbolic(graph, input_, group=None):
        return _gather_along_last_dim(input_, _tp_group(group))

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _gather_along_last_dim(input_, _tp_group(group))

    @staticmethod
    def backward(ctx, grad_output):
        return _grad(ctx, _split_along_last_dim(grad_output, _ctx_group(ctx)), 1)


# --------------------------------------------------------------------------- sequence parallel
class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's block of the sequence (dim 0); backward all-gathers it."""

    @staticmethod
    def symbolic(graph, input_, group=None):
        return _split_along_first_dim(input_, _tp_group(group))

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _split_along_first_dim(input_, _tp_group(group))

    @staticmethod
    def backward(ctx, grad_output):
        return _grad(ctx, _gather_along_first_dim(grad_output, _ctx_group(ctx)), 1)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence (dim 0): ``g``-bar of Korthikanti et al. §4.2.2, entering a
    tensor-parallel block.

    Backward: when the consumer is tensor-parallel (``tensor_parallel_output_grad=True``, the
    usual case: a column-parallel linear) every rank holds only a partial gradient of the
    full sequence, so the gradients are summed *and* split — one reduce-scatter. Otherwise the
    gradient is already complete on every rank and each rank just keeps its block.
    """

    @staticmethod
    def symbolic(graph, input_, tensor_parallel_output_grad=True, group=None):
        return _gather_along_first_dim(input_, _tp_group(group))

    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad=True, group=None):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_along_first_dim(input_, _tp_group(group))

    @staticmethod
    def backward(ctx, grad_output):
        group = _ctx_group(ctx)
        if getattr(ctx, "tensor_parallel_output_grad", True):
            grad = _reduce_scatter_along_first_dim(grad_output, group)
        else:
            grad = _split_along_first_dim(grad_output, group)
        return _grad(ctx, grad, 2)


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Sum over the group and keep this rank's block of the sequence (dim 0): ``g`` of
    Korthikanti et al. §4.2.2, leaving a tensor-parallel block. Backward all-gathers."""

    @staticmethod
    def symbolic(graph, input_, group=None):
        return _reduce_scatter_along_first_dim(input_, _tp_group(group))

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _reduce_scatter_along_first_dim(input_, _tp_group(group))

    @staticmethod
    def backward(ctx, grad_output):
        return _grad(ctx, _gather_along_first_dim(grad_output, _ctx_group(ctx)), 1)


class _AllGatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension; backward reduce-scatters along it (the gradient
    of a gathered tensor that every rank then used in full)."""

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _gather_along_last_dim(input_, _tp_group(group))

    @staticmethod
    def backward(ctx, grad_output):
        return _grad(ctx, _reduce_scatter_along_last_dim(grad_output, _ctx_group(ctx)), 1)


class _ReduceScatterToTensorParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the last dimension; backward all-gathers along it."""

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _reduce_scatter_along_last_dim(input_, _tp_group(group))

    @staticmethod
    def backward(ctx, grad_output):
        return _grad(ctx, _gather_along_last_dim(grad_output, _ctx_group(ctx)), 1)


# --------------------------------------------------------------------------- public functions
def _apply(fn, input_, group, *args):
    group = _tp_group(group)
    if comm.group_size(group) == 1:
        return input_  # one rank: nothing to communicate, not even an autograd node
    return fn.apply(input_, *args, group)


def copy_to_tensor_model_parallel_region(input_, group=None):
    """``f``: identity forward, all-reduce backward (enter a tensor-parallel region)."""
    return _apply(_CopyToModelParallelRegion, input_, group)


def reduce_from_tensor_model_parallel_region(input_, group=None):
    """``g``: all-reduce forward, identity backward (leave a tensor-parallel region)."""
    return _apply(_ReduceFromModelParallelRegion, input_, group)


def scatter_to_tensor_model_parallel_region(input_, group=None):
    """Split the last dimension, keep this rank's slice; backward all-gathers."""
    return _apply(_ScatterToModelParallelRegion, input_, group)


def gather_from_tensor_model_parallel_region(input_, group=None):
    """All-gather the last dimension; backward keeps this rank's slice."""
    return _apply(_GatherFromModelParallelRegion, input_, group)


def scatter_to_sequence_parallel_region(input_, group=None):
    """Split dim 0 (the sequence of ``[s, b, h]``), keep this rank's block; backward all-gathers."""
    return _apply(_ScatterToSequenceParallelRegion, input_, group)


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None):
    """All-gather dim 0; backward reduce-scatters (or only splits when
    ``tensor_parallel_output_grad=False``)."""
    return _apply(_GatherFromSequenceParallelRegion, input_, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_, group=None):
    """Reduce-scatter dim 0; backward all-gathers."""
    return _apply(_ReduceScatterToSequenceParallelRegion, input_, group)


def all_gather_last_dim_from_tensor_parallel_region(input_, group=None):
    """All-gather the last dimension; backward reduce-scatters it."""
    return _apply(_AllGatherFromTensorParallelRegion, input_, group)


def reduce_scatter_last_dim_to_tensor_parallel_region(input_, group=None):
    """Reduce-scatter the last dimension; backward all-gathers it."""
    return _apply(_ReduceScatterToTensorParallelRegion, input_, group)
