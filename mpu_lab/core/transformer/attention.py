"""Tensor-parallel causal self-attention, :class:`SelfAttention` (Megatron-core's
``core/transformer/attention.py``, class ``SelfAttention``; Megatron's legacy code calls
it ``ParallelAttention``) — Shoeybi et al. 2019, §3, Fig. 3b.

Heads are independent, so tensor parallelism gives each rank ``n_H / t`` whole heads: the
fused QKV projection is column-parallel (each rank computes Q, K and V of its heads only),
attention runs locally, and the output projection ``W^O`` is row-parallel, so one all-reduce
(``g``) finishes the block. Hence the lecture's rule ``d_tp <= n_H`` (and ``n_H % d_tp == 0``).

Fused QKV layout: Megatron-core's, grouped by head. The master weight of ``linear_qkv`` is
``[3D, D]`` and its rows are grouped *by head* (``[q_j; k_j; v_j]`` for head ``j``)::

    rows [3H*j, 3H*j + H)        W^Q of head j
    rows [3H*j + H, 3H*j + 2H)   W^K of head j
    rows [3H*j + 2H, 3H*(j+1))   W^V of head j

Megatron-core does the same (``core/transformer/attention.py``,
``get_query_key_value_tensors`` views the output as ``[s, b, ng, (np/ng + 2) * hn]``: query
group by query group, which is head by head without grouped-query attention). Column-parallel
slicing takes contiguous blocks of ``3D/t`` rows, so rank ``i`` holds heads
``[i*n_H/t, (i+1)*n_H/t)`` with their Q, K and V — no ``stride`` needed. A ``stride`` matters
only for a fused weight stored part after part: the first Megatron-LM (2019,
``mpu/transformer.py``) stored ``[W_Q; W_K; W_V]`` and built ``query_key_value`` with
``stride=3``; Megatron-core's SwiGLU MLP builds ``linear_fc1`` (``[W_gate; W_up]``) with
``stride=2``. Lab 06 (section 5) shows both layouts. The same head-grouped layout is used by
:class:`mpu_lab.training.plain_gpt.PlainGPT` so a consolidated checkpoint loads into either.

The attention itself is ``torch.nn.functional.scaled_dot_product_attention`` with
``is_causal=True`` (``attention_impl="sdpa"``). ``attention_impl="explicit"`` computes the
lecture's formulas step by step (``Score_i = softmax(Q_i K_i^T / sqrt(H))``, ``Z_i = Score_i
V_i``) so the shape table can show the ``L x L`` scores; the two agree to ~1e-6 in fp32.
The scale is ``1/sqrt(H)`` with ``H`` the head dimension (as in Megatron and the Transformer
paper); the lecture's slide writes ``sqrt(D)`` for the same quantity per head.

Context parallelism (``config.context_parallel_size`` = cp > 1): each rank holds ``s/cp`` tokens
of the sequence, in Megatron's zig-zag layout (:func:`mpu_lab.core.context_parallel.get_batch_on_this_cp_rank`),
and only attention needs the other ranks' tokens. The local ``[s/cp, b, n/t, H]`` q, k, v go to
:func:`mpu_lab.core.context_parallel.attention` with ``config.cp_comm_type`` (``"p2p"``, ``"a2a"`` or
``"allgather"``), as Megatron-core's ``TEDotProductAttention`` hands them to TransformerEngine;
the projections around it are unchanged. Dropout inside attention is not supported there.

Selective recomputation (Korthikanti et al. 2022, §5; ``recompute_granularity="selective"``
with ``"core_attn"`` in ``recompute_modules``): the attention core, from q, k, v to the context
``Z`` (softmax, attention dropout), keeps only its inputs and runs again in backward: its
``s x s`` activations are the largest per FLOP (``5as/h`` of the paper's ``34 + 5as/h``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Optional, Union

import torch
import torch.nn.functional as F

from mpu_lab.core import context_parallel, parallel_state
from mpu_lab.core.transformer.spec_utils import ModuleSpec, build_module
from mpu_lab.core.transformer.transformer_config import TransformerConfig
from mpu_lab.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, checkpoint,
                                          get_rng_tracker)


@dataclasses.dataclass
class SelfAttentionSubmodules:
    """The classes (or specs) that build the attention's two linear layers (Megatron-core's
    ``SelfAttentionSubmodules``): ``linear_qkv`` is built column-parallel
    (``gather_output=False``), ``linear_proj`` row-parallel (``input_is_parallel=True``), each
    with the keyword arguments of :class:`~mpu_lab.core.tensor_parallel.ColumnParallelLinear` /
    :class:`~mpu_lab.core.tensor_parallel.RowParallelLinear`."""

    linear_qkv: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_proj: Union[ModuleSpec, type] = RowParallelLinear


def explicit_causal_attention(q, k, v, dropout_p: float = 0.0):
    """The lecture's formulas. ``q, k, v``: ``[b, n, s, H]``; returns ``[b, n, s, H]``."""
    s = q.size(-2)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # [b, n, s, s]
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)              # Score_i
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)                                          # Z_i: [b, n, s, H]


def check_context_parallel_attention(config: TransformerConfig) -> int:
    """The context-parallel size attention runs at (``config.context_parallel_size``);
    ``ValueError`` naming the values when it differs from the CP group of
    :mod:`mpu_lab.core.parallel_state`, or with what the CP attention cannot do."""
    cp = config.context_parallel_size
    if cp > 1:
        _check_context_parallel_options(config)
    groups = parallel_state.get_context_parallel_world_size()
    if cp != groups:
        raise ValueError(f"config.context_parallel_size is {cp} but the CP group size of "
                         f"parallel_state is {groups}: call initialize_model_parallel("
                         f"context_parallel_size={cp}) or set context_parallel_size={groups}")
    return cp


def _check_context_parallel_options(config: TransformerConfig) -> None:
    cp = config.context_parallel_size
    if config.cp_comm_type not in context_parallel.COMM_TYPES:
        raise ValueError(f"cp_comm_type must be one of {context_parallel.COMM_TYPES}, got "
                         f"{config.cp_comm_type!r}")
    if config.attention_dropout > 0:
        raise ValueError(f"attention_dropout {config.attention_dropout} with "
                         f"context_parallel_size {cp}: the context-parallel attention has no "
                         f"dropout; use attention_dropout 0 (hidden_dropout is supported)")
    if config.attention_impl != "sdpa":
        raise ValueError(f"attention_impl {config.attention_impl!r} computes the whole L x L "
                         f"scores on one rank; with context_parallel_size {cp} use 'sdpa' "
                         f"(the CP attention computes its blocks itself)")


class SelfAttention(torch.nn.Module):
    """Causal multi-head self-attention over ``n_H / t`` local heads.

    ``forward(hidden_states)``: ``[s, b, D]`` (``[s/t, b, D]`` with sequence parallelism) ->
    ``(output [s, b, D] or [s/t, b, D], bias of linear_proj)``; the bias is left for the
    caller's bias-dropout-add.
    """

    def __init__(self, config: TransformerConfig,
                 submodules: Optional[SelfAttentionSubmodules] = None):
        super().__init__()
        submodules = submodules if submodules is not None else SelfAttentionSubmodules()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        config.check(tp)
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads          # H
        self.num_local_heads = config.num_attention_heads // tp                   # n_H / t
        self.attention_dropout = config.attention_dropout
        self.attention_impl = config.attention_impl
        self.cp_size = check_context_parallel_attention(config)
        self.checkpoint_core_attention = (config.recompute_granularity == "selective"
                                          and "core_attn" in config.recompute_modules)
        self.linear_qkv = build_module(
            submodules.linear_qkv, config.hidden_size, 3 * config.hidden_size, bias=True,
            gather_output=False, init_method=config.init_method(),
            sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype)
        self.linear_proj = build_module(
            submodules.linear_proj, config.hidden_size, config.hidden_size, bias=True,
            input_is_parallel=True, init_method=config.output_layer_init_method(),
            skip_bias_add=True, sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype)

    def _core_attention(self, q, k, v):
        """Attention over the whole sequence on this rank: ``[b, n, s, H]`` in and out."""
        dropout_p = self.attention_dropout if self.training else 0.0
        # Each rank holds different heads: their dropout masks must differ, so draw them
        # from the tensor-parallel RNG stream (Shoeybi et al. 2019, appendix B.2; lab 06).
        with get_rng_tracker().fork() if dropout_p > 0 else contextlib.nullcontext():
            if self.attention_impl == "explicit":
                return explicit_causal_attention(q, k, v, dropout_p)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)

    def core_attention(self, q, k, v):
        """``[s, b, n, H]`` q, k, v -> the context ``[b, n, s, H]`` (``s/cp`` tokens with CP)."""
        if self.cp_size > 1:
            # Context parallelism: this rank's s/cp tokens (chunks r and 2cp-1-r) attend to
            # the whole sequence, the other CP ranks' keys and values brought by cp_comm_type.
            z = context_parallel.attention(q, k, v, comm_type=self.config.cp_comm_type,
                                           causal=True)                  # [s/cp, b, n, H]
            return z.permute(1, 2, 0, 3)                                 # [b, n, s/cp, H]
        return self._core_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)))  # [b, n, s, H]

    def forward(self, hidden_states: torch.Tensor):
        qkv, _ = self.linear_qkv(hidden_states)                 # [s, b, 3D/t]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.num_local_heads, 3 * self.head_dim)   # [s, b, n, 3H]
        q, k, v = torch.split(qkv, self.head_dim, dim=-1)       # each [s, b, n, H]
        if self.checkpoint_core_attention and self.training:
            # Megatron's _checkpointed_attention_forward: keep q, k, v, recompute the rest
            z = checkpoint(self.core_attention, False, q, k, v)
        else:
            z = self.core_attention(q, k, v)
        z = z.permute(2, 0, 1, 3).reshape(s, b, self.num_local_heads * self.head_dim)  # [s, b, D/t]
        out, bias = self.linear_proj(z)                         # Out = Z W^O, all-reduced: [s, b, D]
        return out, bias
