"""The learner's f and g and the sequence-parallel operators (Shoeybi et al. 2019, §3;
Korthikanti et al. 2022, §4.2.2), as a finished learner writes them: one autograd Function per
operator, each calling ``torch.distributed`` on the tensor-parallel group. Megatron-core's
``tensor_parallel/mappings.py`` has the same names.

    f = copy_to_tensor_model_parallel_region        forward: identity    backward: all-reduce
    g = reduce_from_tensor_model_parallel_region    forward: all-reduce  backward: identity

Part of the finished learner's package in ``labs/solutions/`` (the capstone lab loads it with
``python -m mpu_lab.labkit.capstone --code labs/solutions ...``).
"""
import torch
import torch.distributed as dist

from mpu_lab.core.parallel_state import (get_tensor_model_parallel_group,
                                         get_tensor_model_parallel_rank,
                                         get_tensor_model_parallel_world_size)


def _all_reduce(x):
    if get_tensor_model_parallel_world_size() == 1:
        return x
    x = x.clone()
    dist.all_reduce(x, group=get_tensor_model_parallel_group())
    return x


def _split(x, dim):
    t = get_tensor_model_parallel_world_size()
    if t == 1:
        return x
    return x.chunk(t, dim=dim)[get_tensor_model_parallel_rank()].contiguous()


def _gather(x, dim):
    t = get_tensor_model_parallel_world_size()
    if t == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(t)]
    dist.all_gather(parts, x.contiguous(), group=get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x, dim):
    # the sum over the group, each rank keeping its 1/t block along ``dim``
    return _split(_all_reduce(x), dim)


class _Copy(torch.autograd.Function):            # f
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad)


class _Reduce(torch.autograd.Function):          # g
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Scatter(torch.autograd.Function):         # keep this rank's slice of the last dim
    @staticmethod
    def forward(ctx, x):
        return _split(x, -1)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, -1)


class _Gather(torch.autograd.Function):          # concatenate the slices of the last dim
    @staticmethod
    def forward(ctx, x):
        return _gather(x, -1)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1)


class _ScatterSeq(torch.autograd.Function):      # [s, b, h] -> this rank's [s/t, b, h]
    @staticmethod
    def forward(ctx, x):
        return _split(x, 0)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0)


class _GatherSeq(torch.autograd.Function):       # sequence parallelism's f: all-gather
    @staticmethod
    def forward(ctx, x):
        return _gather(x, 0)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 0)


class _ReduceScatterSeq(torch.autograd.Function):  # sequence parallelism's g
    @staticmethod
    def forward(ctx, x):
        return _reduce_scatter(x, 0)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0)


def copy_to_tensor_model_parallel_region(x):
    return _Copy.apply(x)


def reduce_from_tensor_model_parallel_region(x):
    return _Reduce.apply(x)


def scatter_to_tensor_model_parallel_region(x):
    return _Scatter.apply(x)


def gather_from_tensor_model_parallel_region(x):
    return _Gather.apply(x)


def scatter_to_sequence_parallel_region(x):
    return _ScatterSeq.apply(x)


def gather_from_sequence_parallel_region(x):
    return _GatherSeq.apply(x)


def reduce_scatter_to_sequence_parallel_region(x):
    return _ReduceScatterSeq.apply(x)
