"""The tensor helpers of a mixture-of-experts layer, after Megatron-core's
``core/transformer/moe/moe_utils.py`` (tag core_v0.19.2), without its fused (Transformer
Engine) paths and its drop-and-pad variants.

* routing: :func:`topk_routing_with_score_function` (softmax or sigmoid scores, top-k),
  :func:`apply_router_token_dropping` (expert capacity, Megatron's drop policy ``"probs"``),
  :func:`get_capacity`;
* the load-balancing loss of Switch Transformers (Fedus et al. 2021, §2.2, eq. 4-6; GShard,
  Lepikhin et al. 2020, had an auxiliary loss of the same form):
  :func:`switch_load_balancing_loss_func` and :class:`MoEAuxLossAutoScaler`, which adds the
  loss's gradient in backward;
* the permutations: :func:`permute` (tokens grouped by expert), :func:`unpermute` (back,
  summing a token's expert outputs), :func:`sort_chunks_by_idxs` (reorder blocks of rows).

Tensors are ``[num_tokens, ...]`` (a layer's ``[s, b, h]`` flattened to ``[s*b, h]``);
``routing_map`` is a ``[num_tokens, num_experts]`` bool mask and ``probs`` the same shape,
zero where a token does not go.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

SCORE_FUNCTIONS = ("softmax", "sigmoid")


# --------------------------------------------------------------------------- routing
def topk_routing_with_score_function(logits: torch.Tensor, topk: int, use_pre_softmax: bool = False,
                                     score_function: str = "softmax"
                                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(probs, routing_map)``, both ``[num_tokens, num_experts]``, from ``logits``.

    softmax: top-k of the logits, then a softmax over those k (Mixtral's order); with
    ``use_pre_softmax`` a softmax over all experts first, then its top k (Switch: with k = 1
    the softmax over one logit would be 1, with a zero gradient for the router).
    sigmoid: top-k of ``sigmoid(logits)``, normalised to sum 1 when k > 1 (DeepSeek-V3).
    """
    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, top_indices = torch.topk(scores, k=topk, dim=1)
        else:
            top_logits, top_indices = torch.topk(logits, k=topk, dim=1)
            probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        probs, top_indices = torch.topk(scores, k=topk, dim=1)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)      # [T, E]
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_probs, routing_map


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert may take: ``ceil(num_tokens / num_experts * capacity_factor)``
    (Switch Transformers §2.2, the expert capacity); ``num_tokens`` counts every (token, choice)
    pair, i.e. tokens x k."""
    return math.ceil(num_tokens / num_experts * capacity_factor)


def apply_router_token_dropping(probs: torch.Tensor, routing_map: torch.Tensor, router_topk: int,
                                capacity_factor: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Drop what exceeds each expert's capacity, keeping the highest-probability tokens of each
    expert (Megatron's ``moe_token_drop_policy="probs"``, no padding to capacity). The tokens
    counted are this rank's. Returns the new ``(probs, routing_map)``; a dropped (token,
    expert) pair has probability 0 there, so the token skips that expert."""
    num_tokens, num_experts = probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    if capacity >= num_tokens:         # no expert can overflow
        return probs, routing_map
    _, kept = torch.topk(probs, k=capacity, dim=0, sorted=False)       # [capacity, E]
    capacity_mask = torch.zeros_like(routing_map).scatter(0, kept, True)
    routing_map = routing_map & capacity_mask
    return probs * routing_map, routing_map


# --------------------------------------------------------------------------- load balancing
def switch_load_balancing_loss_func(probs: torch.Tensor, tokens_per_expert: torch.Tensor,
                                    total_num_tokens: int, topk: int, num_experts: int,
                                    moe_aux_loss_coeff: float) -> torch.Tensor:
    """``coeff * E * sum_i f_i * P_i`` (Switch Transformers eq. 4), as Megatron writes it:

        f_i = tokens_per_expert[i] / (T * k)    fraction of the routed choices that go to i
        P_i = sum over tokens of probs[:, i] / T    mean router probability of expert i

    ``probs`` are this rank's ``[tokens, E]`` scores over *all* experts (a softmax), ``T`` the
    tokens of every rank that routes a part of the same sequences (the tensor- and
    context-parallel ranks), ``tokens_per_expert`` counted over those ranks. Each rank's loss
    holds its own tokens' ``P``: the sum over the ranks is the loss of the whole batch. It is
    minimal (= coeff) when the load is uniform."""
    aggregated = probs.sum(dim=0)                                    # [E]
    return torch.sum(aggregated * tokens_per_expert) * (
        num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens))


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Attach an auxiliary loss to an activation: forward returns the activation unchanged;
    backward passes its gradient through and gives the loss the gradient
    ``main_loss_backward_scale`` (1 unless set), as if the loss had been added to the model's
    loss. So no caller has to collect and add the losses of every MoE layer."""

    main_loss_backward_scale: Optional[torch.Tensor] = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        scale = 1.0 if scale is None else scale
        return grad_output, torch.ones_like(aux_loss) * scale

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """The factor the main loss's gradient carries (e.g. 1 / micro-batches)."""
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale


# --------------------------------------------------------------------------- permutations
def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor] = None):
    """Copy each token once per expert it goes to, grouped by expert: expert 0's tokens (in
    token order), then expert 1's, ... Returns ``(permuted_tokens [n, h], permuted_probs [n] or
    None, sorted_indices [n])``, ``sorted_indices[j]`` the token row ``j`` came from."""
    num_tokens = tokens.size(0)
    expert_major = routing_map.t().contiguous()                          # [E, T]
    token_ids = torch.arange(num_tokens, device=tokens.device).expand_as(expert_major)
    sorted_indices = token_ids.masked_select(expert_major)               # [n]
    permuted_probs = None
    if probs is not None:
        permuted_probs = probs.t().contiguous().masked_select(expert_major)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
              restore_shape: torch.Size) -> torch.Tensor:
    """The reverse of :func:`permute`: row ``j`` is added to token ``sorted_indices[j]``, so a
    token sent to k experts gets the sum of their (already probability-weighted) outputs; a
    token that went nowhere (dropped everywhere) gets zeros."""
    output = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    return output.index_add(0, sorted_indices, permuted_tokens)


def sort_chunks_by_idxs(rows: torch.Tensor, split_sizes: List[int], sorted_idxs: List[int]):
    """Cut ``rows`` into chunks of ``split_sizes`` (along dim 0) and concatenate them in the order
    ``sorted_idxs``. The all-to-all dispatcher receives ``[source rank][local expert]`` chunks and
    needs ``[local expert][source rank]``, so each expert's tokens are contiguous."""
    chunks = torch.split(rows, split_sizes, dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs], dim=0)
