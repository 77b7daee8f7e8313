"""Ring attention: ``--cp-comm-type p2p`` (Liu et al. 2023, "Ring Attention with Blockwise
Transformers for Near-Infinite Context"; TransformerEngine's ``AttnFuncWithCPAndKVP2P``).

The CP ranks form a ring. Each keeps its own queries, and the key/value blocks travel: at step
``i`` rank ``r`` holds the block of rank ``r - i`` (mod cp), attends its queries to it, folds the
result into its running ``(out, lse)`` with the log-sum-exp rule (:mod:`.block_attention`),
and passes the block on to rank ``r + 1`` while it computes. After ``cp`` steps every query has
seen every key, and no rank ever held more than two blocks.

The causal mask, block pair by block pair, with Megatron's layout (rank ``r`` holds chunks
``r`` and ``2cp-1-r`` of ``2cp``; :mod:`.layout`):

* step 0, its own block: the usual causal mask (its positions are in increasing order);
* a block from an earlier rank ``j < r`` (chunks ``j`` and ``2cp-1-j``): chunk ``j`` lies before
  both of ``r``'s chunks and chunk ``2cp-1-j`` after both: *all* queries, *front half* of the
  keys, no mask;
* a block from a later rank ``j > r``: both its chunks lie between ``r``'s two: only the *back
  half* of the queries sees them, *all* keys, no mask.

So after step 0 every step costs every rank the same half-block: the load balance that the
layout was chosen for.

The backward pass is a second ring. The blocks travel again. A rank keeps its own queries'
contribution to its own block's ``dK, dV`` at home; from step 1 on, the ``dK, dV`` of the block
it holds travel one step behind the block: it adds its share and passes them to rank ``r + 1``,
which holds that block in the next step. After the last step the next rank is the block's
owner, which adds them to what it kept: ``cp - 1`` hops, so a rank sends ``2(cp - 1)`` blocks of
K, V and ``2(cp - 1)`` of dK, dV, TransformerEngine's count. (TransformerEngine sends the
``dK, dV`` together with the next block; here they go once the block has been used, which keeps
one message in flight at a time.)
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from mpu_lab.core.comm import exchange
from mpu_lab.core.context_parallel.block_attention import (
    block_backward, block_forward, compute_dtype, merge, softmax_delta)

KV_TAG = 31    # message tags: the travelling K/V block,
DKV_TAG = 32   # and its gradient (distinct, so a rank running ahead cannot mix them up)


def block_pair(kv_rank: int, cp_rank: int, causal: bool, chunk: int) -> Tuple[slice, slice, bool]:
    """``(query rows, key rows, diagonal)``: which of CP rank ``cp_rank``'s ``2 * chunk``
    queries attend to which rows of CP rank ``kv_rank``'s key/value block, and whether that
    pair needs the causal (diagonal) mask. Empty pairs never occur: each step has work."""
    both, front, back = slice(0, 2 * chunk), slice(0, chunk), slice(chunk, 2 * chunk)
    if not causal:
        return both, both, False
    if kv_rank == cp_rank:
        return both, both, True      # its own block: causal within it
    if kv_rank < cp_rank:
        return both, front, False    # the earlier rank's front chunk: seen by all; its back: by none
    return back, both, False         # the later rank's chunks: seen by the back chunk only


class AttnFuncWithCPAndKVP2P(torch.autograd.Function):
    """Ring attention on this rank's ``[s/cp, b, n, d]`` q, k, v (Megatron's layout) over the
    CP ``group``; returns this rank's ``[s/cp, b, n, d]`` output."""

    @staticmethod
    @torch.autocast("cpu", enabled=False)     # the blocks and their merge stay in fp32 under a
    @torch.autocast("cuda", enabled=False)    # mixed-precision run (inputs are upcast below)
    def forward(ctx, q, k, v, causal: bool, scale: float, group):
        cp_size, cp_rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        send_to, recv_from = (cp_rank + 1) % cp_size, (cp_rank - 1) % cp_size
        chunk = q.size(0) // 2
        dtype = compute_dtype(q.dtype)
        q_acc = q.to(dtype)
        kv = torch.stack([k, v])                   # [2, s/cp, b, n, d]: one message per step
        out = lse = None                           # [s/cp, b, n, d], [b, n, s/cp]
        for step in range(cp_size):
            if step + 1 < cp_size:                 # the next block travels while this one computes
                incoming = exchange.send_recv_async(kv, send_to, recv_from, group, tag=KV_TAG)
            kv_rank = (cp_rank - step) % cp_size
            rows, cols, diagonal = block_pair(kv_rank, cp_rank, causal, chunk)
            block_out, block_lse = block_forward(q_acc[rows], kv[0, cols].to(dtype),
                                                 kv[1, cols].to(dtype), diagonal, scale)
            if out is None:                        # step 0: its own block, every query row
                out, lse = block_out, block_lse
            else:
                out[rows], lse[..., rows] = merge(out[rows], lse[..., rows], block_out, block_lse)
            if step + 1 < cp_size:
                kv = incoming.wait()
        # einsum leaves the blocks' output in [b, n, s, d] memory order: made contiguous once
        # here, the layer's reshape after attention is a view of the tensor saved for backward
        # instead of a second copy of it.
        out = out.contiguous()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.group = causal, scale, group
        return out.to(q.dtype)

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        cp_size, cp_rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        send_to, recv_from = (cp_rank + 1) % cp_size, (cp_rank - 1) % cp_size
        chunk = q.size(0) // 2
        dtype = out.dtype
        q_acc, dout_acc = q.to(dtype), dout.to(dtype)
        delta = softmax_delta(dout_acc, out)       # [b, n, s/cp]
        dq = torch.zeros_like(q_acc)
        kv = torch.stack([k, v])
        dkv_own = torch.zeros(kv.shape, dtype=dtype, device=kv.device)  # this rank's block's dK, dV
        dkv = torch.zeros_like(dkv_own)        # the dK, dV of the block held, travelling with it
        for step in range(cp_size):
            if step + 1 < cp_size:
                incoming = exchange.send_recv_async(kv, send_to, recv_from, group, tag=KV_TAG)
            kv_rank = (cp_rank - step) % cp_size
            rows, cols, diagonal = block_pair(kv_rank, cp_rank, causal, chunk)
            dq_block, dk_block, dv_block = block_backward(
                q_acc[rows], kv[0, cols].to(dtype), kv[1, cols].to(dtype), dout_acc[rows],
                lse[..., rows], delta[..., rows], diagonal, scale)
            dq[rows] += dq_block
            held = dkv_own if step == 0 else dkv
            held[0, cols] += dk_block
            held[1, cols] += dv_block
            if step + 1 < cp_size:
                kv = incoming.wait()
            if step > 0:
                # dK, dV follow their block to the rank that uses it next; after the last step
                # the next rank is the block's owner: this rank receives its own block's share
                # from the others, and the rank before it starts the next block's from zero.
                dkv = exchange.send_recv(dkv, send_to, recv_from, group, tag=DKV_TAG)
        dkv = dkv_own + dkv            # at cp = 1 nothing travelled: dkv is still zero
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float, group) -> torch.Tensor:
    """:class:`AttnFuncWithCPAndKVP2P` applied (inputs already checked by ``attention``)."""
    return AttnFuncWithCPAndKVP2P.apply(q, k, v, causal, scale, group)
