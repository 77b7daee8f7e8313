"""The exchanges of context, expert and pipeline parallelism, on :mod:`mpu_lab.core.comm`'s host
staging.

* :func:`all_to_all` — sequence-split to head-split and back (Ulysses, ``--cp-comm-type a2a``);
* :func:`send_recv` / :func:`send_recv_async` — one step of a ring (ring attention, ``p2p``);
* :func:`all_to_all_with_splits` — MoE token dispatch, a different number of rows per peer;
* :func:`isend_irecv` — the messages between neighbouring pipeline stages, in a given order.

Like the collectives of :mod:`mpu_lab.core.comm`, each returns a new tensor (or a
:class:`~mpu_lab.core.comm.Pending` for it) and works on gloo and NCCL, torch 2.11 to 2.15.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from mpu_lab.core.comm import Pending, chunk_count, from_backend, group_size, to_backend
from mpu_lab.core.comm.hooks import reported


@reported("all_to_all")
def all_to_all(tensor: torch.Tensor, group=None, scatter_dim: int = 0,
               gather_dim: int = 0) -> torch.Tensor:
    """Cut ``tensor`` into one chunk per rank of ``group`` along ``scatter_dim``; chunk ``j`` goes
    to group rank ``j``, and the chunks received (from group ranks 0, 1, ...) are concatenated
    along ``gather_dim``. Megatron-core's ``tensor_parallel.mappings.all_to_all`` with the split
    and the concatenation dims named. One ``all_to_all_single``."""
    n = chunk_count(tensor, group, scatter_dim, "all_to_all")
    src, device = to_backend(tensor.detach(), group)
    send = torch.stack(torch.chunk(src, n, dim=scatter_dim)).contiguous()   # [n, *chunk]
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return from_backend(torch.cat(received.unbind(0), dim=gather_dim), device)


@reported("send_recv", is_async=True)
def send_recv_async(tensor: torch.Tensor, dst: int, src: int, group=None, tag: int = 0) -> Pending:
    """Send ``tensor`` to group rank ``dst`` and receive one of the same shape and dtype from
    group rank ``src`` (a ring step: ``dst`` the next rank, ``src`` the previous one), started
    and not waited for, so the caller computes while the messages travel."""
    ranks = (dist.get_process_group_ranks(group) if group is not None
             else list(range(dist.get_world_size())))
    sent, device = to_backend(tensor.detach().contiguous(), group)
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
    # The handles hold ``sent`` until the send is done; ``wait()`` waits for both.
    return Pending("send_recv", group, list(works), lambda: from_backend(received, device))


@reported("send_recv")
def send_recv(tensor: torch.Tensor, dst: int, src: int, group=None, tag: int = 0) -> torch.Tensor:
    """:func:`send_recv_async`, waited for: the tensor received from group rank ``src``."""
    return send_recv_async(tensor, dst, src, group, tag).wait()


@reported("all_to_all")
def all_to_all_with_splits(tensor: torch.Tensor, output_split_sizes, input_split_sizes,
                           group=None) -> torch.Tensor:
    """All-to-all with a different number of rows for each peer (MoE token dispatch): rows
    ``[sum(input_split_sizes[:j]), +input_split_sizes[j])`` of ``tensor`` go to group rank
    ``j``; the rows received, ``output_split_sizes[j]`` from group rank ``j``, are concatenated
    in group-rank order. Megatron-core's ``tensor_parallel.mappings.all_to_all`` forward."""
    input_split_sizes, output_split_sizes = list(input_split_sizes), list(output_split_sizes)
    n = group_size(group)
    if len(input_split_sizes) != n or len(output_split_sizes) != n:
        raise ValueError(f"all_to_all_with_splits: {len(input_split_sizes)} input and "
                         f"{len(output_split_sizes)} output split sizes for a group of {n}")
    if sum(input_split_sizes) != tensor.size(0):
        raise ValueError(f"all_to_all_with_splits: input split sizes {input_split_sizes} add "
                         f"up to {sum(input_split_sizes)}, not the {tensor.size(0)} rows given")
    src, device = to_backend(tensor.detach().contiguous(), group)
    received = src.new_empty((sum(output_split_sizes),) + tuple(src.shape[1:]))
    dist.all_to_all_single(received, src, output_split_sizes, input_split_sizes, group=group)
    return from_backend(received, device)


@reported("p2p")
def isend_irecv(ops: Sequence[dist.P2POp], group) -> None:
    """Post every message of ``ops`` (torch's ``P2POp``: ``dist.isend`` or ``dist.irecv``, a
    tensor the backend takes, the peer's global rank, a tag) as a plain ``isend`` / ``irecv``
    in the order given, then wait for all of them: torch's ``batch_isend_irecv`` written out,
    which is not dependable on gloo. The order is the caller's:
    :mod:`mpu_lab.core.pipeline_parallel.p2p_communication` posts Megatron's (``_p2p_ops``), so
    two neighbours never wait on each other."""
    works = [op.op(op.tensor, op.peer, group=group, tag=op.tag) for op in ops]
    for work in works:
        work.wait()
