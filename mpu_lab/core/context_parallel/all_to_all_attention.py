"""All-to-all attention: ``--cp-comm-type a2a`` (DeepSpeed-Ulysses, Jacobs et al. 2023;
TransformerEngine's ``AttnFuncWithCPAndQKVOA2A``; the same exchange as Megatron-core's
``ssm/mamba_context_parallel.py`` ``_all_to_all_cp2hp`` / ``_all_to_all_hp2cp``).

Attention needs the whole sequence, but each head is independent of the others. So one
all-to-all turns "every rank has s/cp tokens of all n heads" into "every rank has all s tokens
of n/cp heads"; each rank runs ordinary causal attention on its heads; a second all-to-all
turns the output back. Two all-to-alls of q, k, v and the output per layer, whose volume per
rank shrinks as cp grows (Ulysses' argument); the limit is cp <= n (n divisible by cp).

After the first all-to-all the sequence arrives in rank order (rank 0's two chunks, rank 1's,
...), which is not natural order under Megatron's layout: it is reordered before the causal
attention and put back in rank order after it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpu_lab.core.comm import exchange
from mpu_lab.core.context_parallel.layout import natural_to_rank_order, rank_order_to_natural


class AllToAll(torch.autograd.Function):
    """Forward: :func:`mpu_lab.core.comm.exchange.all_to_all` (split ``scatter_dim`` across the ranks,
    concatenate what arrives along ``gather_dim``). Backward: the same exchange reversed."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return exchange.all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return exchange.all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all_cp2hp(x: torch.Tensor, group) -> torch.Tensor:
    """``[..., s/cp, b, n, d]`` sequence-split -> ``[..., s, b, n/cp, d]`` head-split (the
    sequence in rank order)."""
    return AllToAll.apply(x, group, x.dim() - 2, x.dim() - 4)


def all_to_all_hp2cp(x: torch.Tensor, group) -> torch.Tensor:
    """``[..., s, b, n/cp, d]`` head-split (sequence in rank order) -> ``[..., s/cp, b, n, d]``."""
    return AllToAll.apply(x, group, x.dim() - 4, x.dim() - 2)


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                         scale: float, group) -> torch.Tensor:
    """This rank's ``[s/cp, b, n, d]`` output (inputs already checked by ``attention``)."""
    cp_size = dist.get_world_size(group=group)
    seq_length = q.size(0) * cp_size
    qkv = all_to_all_cp2hp(torch.stack([q, k, v]), group)           # [3, s, b, n/cp, d]
    qkv = qkv.index_select(1, rank_order_to_natural(cp_size, seq_length, q.device))
    q_h, k_h, v_h = (t.permute(1, 2, 0, 3) for t in qkv.unbind(0))   # [b, n/cp, s, d]
    out = F.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=causal, scale=scale)
    out = out.permute(2, 0, 1, 3)                                    # [s, b, n/cp, d]
    out = out.index_select(0, natural_to_rank_order(cp_size, seq_length, q.device))
    return all_to_all_hp2cp(out, group)                              # [s/cp, b, n, d]
