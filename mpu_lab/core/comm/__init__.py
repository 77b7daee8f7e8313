"""The one place where :mod:`mpu_lab` calls ``torch.distributed`` collectives, for portability:
the same calls on gloo and NCCL and on torch 2.11 to 2.15 (the list-based ``all_gather``; the
tensor-based reduce-scatter, as gloo's list-based one runs an all-reduce per rank), with the
tensor staged through host memory when several ranks share one GPU through gloo (:mod:`.staging`).
No counter, tag or timer: the labs count these calls with torch's ``CommDebugMode``
(:mod:`mpu_lab.perf.comm_counts`) and time them at the hook point of :mod:`.hooks`.

All functions take ``group`` and return a *new* tensor (inputs are never modified); the
``*_async`` ones return a :class:`Pending` whose ``wait()`` gives it, so a layer can compute
while the transfer runs (Megatron's linear does, in backward). The all-to-all, ring and
pipeline exchanges are in :mod:`mpu_lab.core.comm.exchange`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from mpu_lab.core.comm.hooks import reported, waiting
from mpu_lab.core.comm.staging import from_backend, to_backend


def group_size(group) -> int:
    return dist.get_world_size(group=group)


def chunk_count(tensor: torch.Tensor, group, dim: int, caller: str) -> int:
    """The group size, after checking that ``dim`` of ``tensor`` splits into that many chunks."""
    n = group_size(group)
    if tensor.size(dim) % n:
        raise ValueError(f"{caller}: size {tensor.size(dim)} of dim {dim} is not divisible "
                         f"by the group size {n}")
    return n


class Pending:
    """A collective in flight (``torch.distributed``'s ``async_op=True``): :meth:`wait` blocks
    until it is done and returns its result. gloo runs it on its own thread and NCCL on its own
    stream, so what the caller computes before ``wait()`` overlaps the transfer. ``work``: torch's
    handle (Megatron's ``handle``), or the list of handles of a send and a receive."""

    def __init__(self, kind: str, group, work, finish: Callable[[], torch.Tensor]):
        self.kind, self.group, self.work, self._finish = kind, group, work, finish
        self._result, self.call = None, None   # call: the hooks.Call of its issue, if reported

    def wait(self) -> torch.Tensor:
        if self._result is None:
            with waiting(self):
                for work in self.work if isinstance(self.work, list) else [self.work]:
                    work.wait()
                self._result = self._finish()
        return self._result


@reported("all_reduce", is_async=True)
def all_reduce_async(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> Pending:
    """Sum (or ``op``) of ``tensor`` over ``group``, for every rank; started, not waited for."""
    work_tensor, device = to_backend(tensor.detach().clone().contiguous(), group)
    work = dist.all_reduce(work_tensor, op=op, group=group, async_op=True)
    return Pending("all_reduce", group, work, lambda: from_backend(work_tensor, device))


@reported("all_gather", is_async=True)
def all_gather_async(tensor: torch.Tensor, group=None, dim: int = 0) -> Pending:
    """Every rank's ``tensor`` concatenated along ``dim``, in group-rank order; started."""
    src, device = to_backend(tensor.detach().contiguous(), group)
    parts = [torch.empty_like(src) for _ in range(group_size(group))]
    work = dist.all_gather(parts, src, group=group, async_op=True)
    return Pending("all_gather", group, work,
                   lambda: from_backend(torch.cat(parts, dim=dim), device))


# torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single (the old name warns there).
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@reported("reduce_scatter", is_async=True)
def reduce_scatter_async(tensor: torch.Tensor, group=None, dim: int = 0) -> Pending:
    """The sum over ``group`` of ``tensor``, of which this rank keeps its chunk of ``dim``
    (chunks in group-rank order); started, not waited for."""
    n = chunk_count(tensor, group, dim, "reduce_scatter")
    src, device = to_backend(tensor.detach(), group)
    chunks = torch.chunk(src, n, dim=dim)                     # chunk j is for group rank j
    out = torch.empty_like(chunks[0], memory_format=torch.contiguous_format)
    work = _reduce_scatter_tensor(out, torch.cat(chunks), group=group, async_op=True)
    return Pending("reduce_scatter", group, work, lambda: from_backend(out, device))


@reported("all_reduce")
def all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or ``op``) of ``tensor`` over ``group``; every rank gets the result."""
    return all_reduce_async(tensor, group, op).wait()


@reported("all_gather")
def all_gather(tensor: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """:func:`all_gather_async`, waited for."""
    return all_gather_async(tensor, group, dim).wait()


@reported("reduce_scatter")
def reduce_scatter(tensor: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """:func:`reduce_scatter_async`, waited for."""
    return reduce_scatter_async(tensor, group, dim).wait()


@reported("broadcast")
def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """``tensor`` of global rank ``src``, on every rank of ``group`` (a new tensor)."""
    work, device = to_backend(tensor.detach().clone().contiguous(), group)
    dist.broadcast(work, src=src, group=group)
    return from_backend(work, device)
