"""Attention of one block of queries on one block of keys and values, with the log-sum-exp that
lets partial results over disjoint key blocks be merged exactly.

Softmax attention over keys split in blocks A and B is not the sum of the two blocks'
attentions, but it is a weighted sum of them: with ``lse_X = log sum_{k in X} exp(q.k * scale)``
(one number per query row),

    lse = log(exp(lse_A) + exp(lse_B))
    out = exp(lse_A - lse) * out_A + exp(lse_B - lse) * out_B

This is the online softmax (Milakov & Gimelshein 2018) that FlashAttention (Dao et al. 2022)
runs inside one GPU and ring attention (Liu et al. 2023) runs across devices: each
rank keeps ``(out, lse)`` for its queries and folds in one key/value block per ring step.
TransformerEngine's ``AttnFuncWithCPAndKVP2P`` does the same with flash-attention kernels
(``flash_attn_fwd_out_correction``); here the blocks are computed explicitly.

The backward of a block needs only the *final* ``lse`` and ``delta = rowsum(dout * out)``
(FlashAttention's backward): the block's share of the softmax is ``exp(scores - lse)``.

Layout, as Megatron's attention: sequence first, ``q [sq, b, n, d]``, ``k, v [sk, b, n, d]``;
``lse`` and ``delta`` are ``[b, n, sq]``. Everything is computed in at least fp32.
"""
from __future__ import annotations

from typing import Tuple

import torch


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """``q . k * scale``, ``[b, n, sq, sk]``; with ``causal`` (a diagonal block: q and k are the
    same positions) a key after its query gets -inf."""
    scores = torch.einsum("qbnd,kbnd->bnqk", q, k) * scale
    if causal:
        sq, sk = q.size(0), k.size(0)
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _rows(weight: torch.Tensor) -> torch.Tensor:
    """A per-query ``[b, n, sq]`` weight, shaped to scale a ``[sq, b, n, d]`` tensor."""
    return weight.permute(2, 0, 1).unsqueeze(-1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 when the inputs are fp64."""
    return torch.promote_types(dtype, torch.float32)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out [sq, b, n, d], lse [b, n, sq])`` of ``q`` attending to this block's keys only."""
    scores = _scores(q, k, causal, scale)                 # [b, n, sq, sk]
    lse = torch.logsumexp(scores, dim=-1)                 # [b, n, sq]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("bnqk,kbnd->qbnd", probs, v)       # [sq, b, n, d]
    return out, lse


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fold one block's ``(block_out, block_lse)`` into the running ``(out, lse)`` of the same
    queries (the rule at the top of this module)."""
    new_lse = torch.logaddexp(lse, block_lse)
    new_out = out * _rows(torch.exp(lse - new_lse)) + block_out * _rows(torch.exp(block_lse - new_lse))
    return new_out, new_lse


def softmax_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``delta = rowsum(dout * out)``, ``[b, n, sq]``: the softmax backward's correction term."""
    return (dout * out).sum(dim=-1).permute(1, 2, 0)


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, causal: bool,
                   scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's contribution to ``(dq, dk, dv)``, given the final ``lse`` and ``delta`` of
    the queries (over all blocks)."""
    probs = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))   # block's share, [b, n, sq, sk]
    dv = torch.einsum("bnqk,qbnd->kbnd", probs, dout)
    dprobs = torch.einsum("qbnd,kbnd->bnqk", dout, v)
    dscores = probs * (dprobs - delta.unsqueeze(-1))                       # softmax backward
    dq = torch.einsum("bnqk,kbnd->qbnd", dscores, k) * scale
    dk = torch.einsum("bnqk,qbnd->kbnd", dscores, q) * scale
    return dq, dk, dv
