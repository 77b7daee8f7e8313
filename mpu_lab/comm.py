"""The one place where :mod:`mpu_lab` calls ``torch.distributed`` collectives.

Why one place:

* **Portability.** The same calls on gloo and NCCL and on every torch from 2.11 (the floor in
  requirements.txt) to 2.15: the list-based ``all_gather``, and the tensor-based reduce-scatter
  (gloo's list-based ``reduce_scatter`` runs one all-reduce per rank: 23 ms against 4 ms for
  one all-reduce, 4 ranks on 2 cores), whose name changed in 2.13 (one line below). gloo
  cannot run every collective on CUDA tensors, so when several ranks share one GPU through
  gloo the tensor is staged through host memory here.
* **Nothing else.** No counter, tag or timer: what the labs observe (how many collectives a
  layer issues in forward and in backward, how long they take) is measured from outside, with
  torch's ``CommDebugMode`` (:mod:`mpu_lab.perf.comm_counts`), and by timing wrappers that
  :mod:`mpu_lab.perf.comm_timing` puts around these functions while a timer is open.

All functions take ``group`` and return a *new* tensor (inputs are never modified); the
``*_async`` ones return a :class:`Pending` whose ``wait()`` gives it, so a layer can compute
while the transfer runs (Megatron's linear does, in backward).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return dist.get_world_size(group=group)


def _to_backend(tensor: torch.Tensor, group):
    """``(tensor the backend can take, device to return the result to or None)``.

    gloo cannot run every collective on CUDA tensors (several ranks sharing one GPU), so
    there the tensor goes through host memory; everywhere else it is used as it is.
    """
    if tensor.is_cuda and dist.get_backend(group) == "gloo":
        return tensor.cpu(), tensor.device
    return tensor, None


def _from_backend(tensor: torch.Tensor, device) -> torch.Tensor:
    return tensor if device is None else tensor.to(device)


def _scatter_size(tensor: torch.Tensor, group, dim: int) -> int:
    """The group size, after checking that ``dim`` of ``tensor`` splits into that many chunks."""
    n = group_size(group)
    if tensor.size(dim) % n:
        raise ValueError(f"reduce_scatter: size {tensor.size(dim)} of dim {dim} is not divisible "
                         f"by the group size {n}")
    return n


class Pending:
    """A collective in flight (``torch.distributed``'s ``async_op=True``): :meth:`wait` blocks
    until it is done and returns its result. gloo runs it on its own thread and NCCL on its own
    stream, so whatever the caller computes before ``wait()`` overlaps the transfer. ``work`` is
    torch's handle of the collective (Megatron keeps it as ``handle``)."""

    def __init__(self, kind: str, group, work, finish: Callable[[], torch.Tensor]):
        self.kind, self.group, self.work, self._finish = kind, group, work, finish
        self._result: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self.work.wait()
            self._result = self._finish()
        return self._result


def all_reduce_async(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> Pending:
    """Sum (or ``op``) of ``tensor`` over ``group``, for every rank; started, not waited for."""
    work_tensor, device = _to_backend(tensor.detach().clone().contiguous(), group)
    work = dist.all_reduce(work_tensor, op=op, group=group, async_op=True)
    return Pending("all_reduce", group, work, lambda: _from_backend(work_tensor, device))


def all_gather_async(tensor: torch.Tensor, group=None, dim: int = 0) -> Pending:
    """Every rank's ``tensor`` concatenated along ``dim``, in group-rank order; started."""
    src, device = _to_backend(tensor.detach().contiguous(), group)
    parts = [torch.empty_like(src) for _ in range(group_size(group))]
    work = dist.all_gather(parts, src, group=group, async_op=True)
    return Pending("all_gather", group, work,
                   lambda: _from_backend(torch.cat(parts, dim=dim), device))


# torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single (the old name warns);
# 2.11 has only the old name. Same arguments, same meaning.
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_async(tensor: torch.Tensor, group=None, dim: int = 0) -> Pending:
    """The sum over ``group`` of ``tensor``, of which this rank keeps its chunk of ``dim``
    (chunks in group-rank order); started, not waited for."""
    n = _scatter_size(tensor, group, dim)
    src, device = _to_backend(tensor.detach(), group)
    chunks = torch.chunk(src, n, dim=dim)                     # chunk j is for group rank j
    out = torch.empty_like(chunks[0], memory_format=torch.contiguous_format)
    work = _reduce_scatter_tensor(out, torch.cat(chunks), group=group, async_op=True)
    return Pending("reduce_scatter", group, work, lambda: _from_backend(out, device))


def all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or ``op``) of ``tensor`` over ``group``; every rank gets the result."""
    work, device = _to_backend(tensor.detach().clone().contiguous(), group)
    dist.all_reduce(work, op=op, group=group)
    return _from_backend(work, device)


def all_gather(tensor: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """:func:`all_gather_async`, waited for."""
    return all_gather_async(tensor, group, dim).wait()


def reduce_scatter(tensor: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """:func:`reduce_scatter_async`, waited for."""
    return reduce_scatter_async(tensor, group, dim).wait()


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """``tensor`` of global rank ``src``, on every rank of ``group`` (a new tensor)."""
    work, device = _to_backend(tensor.detach().clone().contiguous(), group)
    dist.broadcast(work, src=src, group=group)
    return _from_backend(work, device)


# --------------------------------------------------------------------------- context parallel
def all_to_all(tensor: torch.Tensor, group=None, scatter_dim: int = 0,
               gather_dim: int = 0) -> torch.Tensor:
    """Cut ``tensor`` into one chunk per rank of ``group`` along ``scatter_dim``; chunk ``j`` goes
    to group rank ``j``, and the chunks received (from group ranks 0, 1, ...) are concatenated
    along ``gather_dim``. Megatron-core's ``tensor_parallel.mappings.all_to_all`` with the split
    and the concatenation dims named: sequence-split to head-split and back (Ulysses, and
    ``--cp-comm-type a2a``). One ``all_to_all_single`` (gloo and NCCL, torch 2.11 to 2.15)."""
    n = group_size(group)
    if tensor.size(scatter_dim) % n:
        raise ValueError(f"all_to_all: size {tensor.size(scatter_dim)} of dim {scatter_dim} is not "
                         f"divisible by the group size {n}")
    src, device = _to_backend(tensor.detach(), group)
    send = torch.stack(torch.chunk(src, n, dim=scatter_dim)).contiguous()   # [n, *chunk]
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return _from_backend(torch.cat(received.unbind(0), dim=gather_dim), device)


class Exchange:
    """A :func:`send_recv_async` in flight: :meth:`wait` blocks until both messages are done and
    returns the tensor received."""

    def __init__(self, works, sent: torch.Tensor, received: torch.Tensor, device):
        self._works, self._sent, self._received, self._device = list(works), sent, received, device

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], None      # the send buffer may be freed now
        return _from_backend(self._received, self._device)


def send_recv_async(tensor: torch.Tensor, dst: int, src: int, group=None, tag: int = 0) -> Exchange:
    """Send ``tensor`` to group rank ``dst`` and receive one of the same shape and dtype from
    group rank ``src`` (a ring step: ``dst`` the next rank, ``src`` the previous one), started
    and not waited for, so the caller computes while the messages travel."""
    ranks = (dist.get_process_group_ranks(group) if group is not None
             else list(range(dist.get_world_size())))
    sent, device = _to_backend(tensor.detach().contiguous(), group)
    received = torch.empty_like(sent)
    if dist.get_backend(group) == "gloo":
        # plain isend/irecv in the same order on every rank: gloo's isend does not wait for the
        # receiver, and batch_isend_irecv is not dependable on gloo.
        works = [dist.isend(sent, ranks[dst], group=group, tag=tag),
                 dist.irecv(received, ranks[src], group=group, tag=tag)]
    else:
        # NCCL: one grouped call, so two ranks sending to each other never wait on each other.
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, ranks[dst], group, tag),
                                        dist.P2POp(dist.irecv, received, ranks[src], group, tag)])
    return Exchange(works, sent, received, device)


def send_recv(tensor: torch.Tensor, dst: int, src: int, group=None, tag: int = 0) -> torch.Tensor:
    """:func:`send_recv_async`, waited for: the tensor received from group rank ``src``."""
    return send_recv_async(tensor, dst, src, group, tag).wait()


# --------------------------------------------------------------------------- expert parallel
def all_to_all_with_splits(tensor: torch.Tensor, output_split_sizes, input_split_sizes,
                           group=None) -> torch.Tensor:
    """All-to-all with a different number of rows for each peer (MoE token dispatch): rows
    ``[sum(input_split_sizes[:j]), +input_split_sizes[j])`` of ``tensor`` go to group rank
    ``j``; the rows received, ``output_split_sizes[j]`` from group rank ``j``, are concatenated
    in group-rank order. Megatron-core's ``tensor_parallel.mappings.all_to_all`` forward. One
    ``all_to_all_single`` with split sizes (gloo and NCCL, torch 2.11 to 2.15)."""
    input_split_sizes, output_split_sizes = list(input_split_sizes), list(output_split_sizes)
    n = group_size(group)
    if len(input_split_sizes) != n or len(output_split_sizes) != n:
        raise ValueError(f"all_to_all_with_splits: {len(input_split_sizes)} input and "
                         f"{len(output_split_sizes)} output split sizes for a group of {n}")
    if sum(input_split_sizes) != tensor.size(0):
        raise ValueError(f"all_to_all_with_splits: input split sizes {input_split_sizes} add "
                         f"up to {sum(input_split_sizes)}, not the {tensor.size(0)} rows given")
    src, device = _to_backend(tensor.detach().contiguous(), group)
    received = src.new_empty((sum(output_split_sizes),) + tuple(src.shape[1:]))
    dist.all_to_all_single(received, src, output_split_sizes, input_split_sizes, group=group)
    return _from_backend(received, device)
