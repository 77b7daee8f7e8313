"""``attention``: causal self-attention over a sequence split across the context-parallel ranks,
with the communication chosen as Megatron's ``--cp-comm-type`` chooses it (TransformerEngine's
``attn_forward_func_with_cp``, which dispatches to the three classes below).

| ``comm_type`` | what travels | mirrors |
|---|---|---|
| ``"p2p"`` | K/V blocks around a ring, cp - 1 steps | ``AttnFuncWithCPAndKVP2P`` (ring attention) |
| ``"a2a"`` | q, k, v and the output, all-to-all | ``AttnFuncWithCPAndQKVOA2A`` (Ulysses) |
| ``"allgather"`` | all of K and V to every rank | ``AttnFuncWithCPAndKVAllGather`` (Llama 3) |

Every input is checked here, before any message is sent, so a bad shape fails on every rank
with the same clear error instead of leaving a peer waiting in a collective.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpu_lab.core.context_parallel.all_gather_attention import all_gather_attention
from mpu_lab.core.context_parallel.all_to_all_attention import all_to_all_attention
from mpu_lab.core.context_parallel.layout import optional_group
from mpu_lab.core.context_parallel.ring_attention import ring_attention

COMM_TYPES = ("p2p", "a2a", "allgather")
_IMPLEMENTATIONS = {"p2p": ring_attention, "a2a": all_to_all_attention,
                    "allgather": all_gather_attention}


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm_type: str,
                           causal: bool, cp_size: int) -> None:
    """``ValueError`` naming the numbers for any input ``attention`` cannot take."""
    if comm_type not in COMM_TYPES:
        raise ValueError(f"unknown comm_type {comm_type!r}: valid ones are "
                         f"{', '.join(repr(c) for c in COMM_TYPES)}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not torch.is_tensor(t) or t.dim() != 4:
            shape = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
            raise ValueError(f"{name} must be a 4-d tensor [s/cp, b, n, d] (sequence first), "
                             f"got {shape}")
    if not q.shape == k.shape == v.shape:
        raise ValueError(f"q, k and v must have the same shape [s/cp, b, n, d], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    local, heads = q.size(0), q.size(2)
    if cp_size > 1 and local % 2:
        raise ValueError(
            f"this rank holds s/cp = {local} tokens, an odd number: with cp={cp_size} each rank "
            f"holds 2 of 2*cp equal chunks, so s = {local * cp_size} must be a multiple of "
            f"2*cp = {2 * cp_size} (s/cp even), e.g. s = {(local + 1) * cp_size}")
    if comm_type == "a2a" and heads % cp_size:
        raise ValueError(
            f"comm_type 'a2a' splits the heads across the CP ranks: n={heads} heads is not "
            f"divisible by cp={cp_size}; use n a multiple of {cp_size}, or comm_type 'p2p' or "
            f"'allgather'")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm_type: str = "p2p",
              causal: bool = True, group=None,
              softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Self-attention of this CP rank's ``[s/cp, b, n, d]`` q, k, v, laid out as
    :func:`~mpu_lab.core.context_parallel.get_batch_on_this_cp_rank` lays tokens out (chunks ``r``
    and ``2cp-1-r``); returns this rank's ``[s/cp, b, n, d]`` output. It equals (forward and the
    gradients of q, k, v) attention over the whole sequence, then split the same way.

    ``comm_type``: ``"p2p"`` (ring), ``"a2a"`` (needs n divisible by cp) or ``"allgather"``.
    ``group``: the CP process group; None means :mod:`mpu_lab.core.parallel_state`'s.
    ``softmax_scale``: defaults to ``1/sqrt(d)``. With cp = 1 this is plain attention.
    """
    cp_group = optional_group(group)
    cp_size = dist.get_world_size(group=cp_group)
    check_attention_inputs(q, k, v, comm_type, causal, cp_size)
    scale = 1.0 / math.sqrt(q.size(-1)) if softmax_scale is None else float(softmax_scale)
    if cp_size == 1:
        out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                             v.permute(1, 2, 0, 3), is_causal=causal, scale=scale)
        return out.permute(2, 0, 1, 3)
    return _IMPLEMENTATIONS[comm_type](q, k, v, causal, scale, cp_group)
