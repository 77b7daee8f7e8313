"""All-gather attention: ``--cp-comm-type allgather`` (the Llama 3 paper's context parallelism,
section 3.3.2; TransformerEngine's ``AttnFuncWithCPAndKVAllGather``).

Each rank gathers every rank's keys and values (one all-gather of K and V together), puts them
back in natural order, and attends its own two query chunks to them with the causal mask:
query chunk ``g`` (positions ``g*c .. g*c + c - 1``) needs only the keys up to the end of its
own chunk, so the keys after it are never even read. Llama 3 chose this over the ring because
the all-gather is simple, works with any mask, and K/V are small under grouped-query
attention; the price is holding the whole sequence's K and V on every rank.

Backward: the gathered K and V received gradient from every rank's queries; a reduce-scatter
sums them and hands each rank the gradient of the block it owns (:class:`AllGatherKV`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpu_lab.core import comm
from mpu_lab.core.context_parallel.layout import chunk_ids, rank_order_to_natural


class AllGatherKV(torch.autograd.Function):
    """Forward: every CP rank's ``x`` concatenated along ``dim`` in rank order (all-gather).
    Backward: the gradient summed over the ranks, each keeping the slice of its own ``x``
    (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, dim: int):
        ctx.group, ctx.dim = group, dim
        return comm.all_gather(x, group=group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return comm.reduce_scatter(grad.contiguous(), group=ctx.group, dim=ctx.dim), None, None


def causal_mask(query_positions: torch.Tensor, key_count: int) -> torch.Tensor:
    """``[len(query_positions), key_count]`` booleans: True where key ``j`` is at or before the
    query (SDPA's convention: True takes part)."""
    keys = torch.arange(key_count, device=query_positions.device)
    return keys.unsqueeze(0) <= query_positions.unsqueeze(1)


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                         scale: float, group) -> torch.Tensor:
    """This rank's ``[s/cp, b, n, d]`` output (inputs already checked by ``attention``)."""
    cp_size, cp_rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    chunk, seq_length = q.size(0) // 2, q.size(0) * cp_size
    kv = AllGatherKV.apply(torch.stack([k, v]), group, 1)            # [2, s, b, n, d], rank order
    kv = kv.index_select(1, rank_order_to_natural(cp_size, seq_length, q.device))   # natural order
    outs = []
    for half, chunk_id in enumerate(chunk_ids(cp_rank, cp_size)):
        q_chunk = q[half * chunk:(half + 1) * chunk]                  # [c, b, n, d]
        seen = (chunk_id + 1) * chunk if causal else seq_length       # keys up to this chunk's end
        mask = None
        if causal:
            positions = torch.arange(chunk_id * chunk, seen, device=q.device)
            mask = causal_mask(positions, seen)
        out = F.scaled_dot_product_attention(                          # on [b, n, s, d]
            q_chunk.permute(1, 2, 0, 3), kv[0, :seen].permute(1, 2, 0, 3),
            kv[1, :seen].permute(1, 2, 0, 3), attn_mask=mask, scale=scale)
        outs.append(out.permute(2, 0, 1, 3))                          # [c, b, n, d]
    return torch.cat(outs, dim=0)
