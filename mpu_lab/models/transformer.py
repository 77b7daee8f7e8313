"""Transformer layer and block, tensor- and sequence-parallel.

One pre-LayerNorm GPT layer (Megatron's ``TransformerLayer``)::

    x = x + dropout(attention(LN(x)) + b_O)        # one g (all-reduce) in the attention
    x = x + dropout(mlp(LN(x)) + b_2)              # one g in the MLP

so, per layer and step, **2 all-reduces forward and 2 backward** (the two ``f``s at the
inputs of the column-parallel QKV and fc1 layers) — Shoeybi et al. 2019, §3, Fig. 4.

Sequence parallelism (Korthikanti et al. 2022, §4.2.2). LayerNorm, dropout and the residual
adds act on each token independently, so between the tensor-parallel blocks each rank keeps
only its ``s/t`` tokens (``[s/t, b, h]``): every ``g`` becomes a reduce-scatter and every ``f``
an all-gather (same bytes, ``t`` times less activation memory outside the blocks). Each rank
now computes LayerNorm (and the row-parallel biases) on different tokens, so those
parameters' gradients are partial sums: :func:`finalize_model_grads` all-reduces them over the
tensor-parallel group before the optimizer step. Dropout on different tokens must draw
different masks: it runs inside ``get_rng_tracker().fork()``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Iterable, List, Optional

import torch
import torch.nn.functional as F

from mpu_lab import comm, parallel_state
from mpu_lab.models.attention import ParallelAttention
from mpu_lab.models.mlp import ACTIVATIONS, ParallelMLP
from mpu_lab.tensor_parallel import get_rng_tracker
from mpu_lab.utils import divisors


@dataclasses.dataclass
class TransformerConfig:
    """The model's shape and options (a subset of Megatron-core's ``TransformerConfig``)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: Optional[int] = None       # default 4 * hidden_size, as in the lecture
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    activation: str = "gelu"                    # "gelu" (GPT) or "relu" (the lecture's table)
    sequence_parallel: bool = False
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    params_dtype: torch.dtype = torch.float32
    attention_impl: str = "sdpa"                # "sdpa" or "explicit" (shows the L x L scores)

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size

    # ------------------------------------------------------------------ checks (pure)
    def check(self, tensor_model_parallel_size: int = 1, seq_length: Optional[int] = None) -> None:
        """Raise ``ValueError`` naming the numbers when this shape cannot be split ``t`` ways."""
        t = tensor_model_parallel_size
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if t < 1:
            raise ValueError(f"tensor_model_parallel_size must be >= 1, got {t}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads} (D = n_H x H needs a whole head dimension H); "
                f"head counts that divide {self.hidden_size}: "
                f"{[d for d in divisors(self.hidden_size) if d <= 128]}")
        if self.num_attention_heads % t:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by the "
                f"tensor-parallel size {t}: each rank must hold whole heads (the lecture's "
                f"d_tp <= n_H, and n_H % d_tp == 0); valid tensor-parallel sizes: "
                f"{divisors(self.num_attention_heads)}")
        if self.ffn_hidden_size % t:
            raise ValueError(f"ffn_hidden_size {self.ffn_hidden_size} is not divisible by the "
                             f"tensor-parallel size {t}: each rank holds ffn_hidden_size / t "
                             f"columns of fc1; use a multiple of {t} (e.g. "
                             f"{self.ffn_hidden_size + (-self.ffn_hidden_size) % t}) or a "
                             f"tensor-parallel size in {divisors(self.ffn_hidden_size)}")
        if self.sequence_parallel and seq_length is not None and seq_length % t:
            raise ValueError(
                f"sequence parallelism splits the sequence over the tensor-parallel group: "
                f"seq_length {seq_length} is not divisible by the tensor-parallel size {t}; "
                f"use a multiple of {t} (e.g. {seq_length + (-seq_length) % t})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, "
                             f"got {self.activation!r}")
        if self.attention_impl not in ("sdpa", "explicit"):
            raise ValueError(f"attention_impl must be 'sdpa' or 'explicit', "
                             f"got {self.attention_impl!r}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    # ------------------------------------------------------------------ init methods
    def init_method(self):
        """Megatron's ``init_method_normal(std)``: N(0, std^2)."""
        return functools.partial(torch.nn.init.normal_, mean=0.0, std=self.init_method_std)

    def output_layer_init_method(self):
        """Megatron's ``scaled_init_method_normal``: N(0, (std / sqrt(2 L))^2) for the layers
        that write into the residual stream (GPT-2's scaling)."""
        std = self.init_method_std / math.sqrt(2.0 * self.num_layers)
        return functools.partial(torch.nn.init.normal_, mean=0.0, std=std)


def _layer_norm(config: TransformerConfig) -> torch.nn.LayerNorm:
    from mpu_lab import distributed
    norm = torch.nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon,
                              device=distributed.get_device(), dtype=config.params_dtype)
    for p in norm.parameters():
        # Replicated on the tensor-parallel group; with sequence parallelism each rank sees
        # other tokens, so its gradient must be all-reduced (finalize_model_grads).
        p.sequence_parallel = config.sequence_parallel
    return norm


def _hidden_dropout_context(config: TransformerConfig, training: bool):
    """Where dropout outside the tensor-parallel blocks draws its mask: the default generator
    (the same mask on every rank of the group, which holds the same tokens), or with sequence
    parallelism the tensor-parallel stream (each rank holds other tokens)."""
    if training and config.hidden_dropout > 0 and config.sequence_parallel:
        return get_rng_tracker().fork()
    return contextlib.nullcontext()


class ParallelTransformerLayer(torch.nn.Module):
    """Pre-LN GPT layer: ``x + attn(LN(x))`` then ``x + mlp(LN(x))``; ``[s, b, h]`` in and out
    (``[s/t, b, h]`` with sequence parallelism). ``layer_number`` (0-based) names the layer in
    the communication counter's tags: ``layer{n}.forward`` / ``layer{n}.backward``."""

    def __init__(self, config: TransformerConfig, layer_number: int = 0):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.input_layernorm = _layer_norm(config)
        self.self_attention = ParallelAttention(config)
        self.pre_mlp_layernorm = _layer_norm(config)
        self.mlp = ParallelMLP(config)

    def _bias_dropout_add(self, x, bias, residual):
        if bias is not None:
            x = x + bias
        if self.training and self.config.hidden_dropout > 0:
            with _hidden_dropout_context(self.config, self.training):
                x = F.dropout(x, p=self.config.hidden_dropout, training=True)
        return residual + x

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tag = f"layer{self.layer_number}"
        hidden_states = comm.tag_backward_input(hidden_states, f"{tag}.backward")
        with comm.comm_tag(f"{tag}.forward"):
            ln = self.input_layernorm(hidden_states)
            attn, attn_bias = self.self_attention(ln)
            hidden_states = self._bias_dropout_add(attn, attn_bias, hidden_states)
            ln = self.pre_mlp_layernorm(hidden_states)
            mlp, mlp_bias = self.mlp(ln)
            hidden_states = self._bias_dropout_add(mlp, mlp_bias, hidden_states)
        return comm.tag_backward_output(hidden_states, f"{tag}.backward")


class ParallelTransformer(torch.nn.Module):
    """A stack of layers plus the final LayerNorm when ``post_process`` (the last pipeline
    stage). ``layer_offset`` numbers this stage's layers globally (pipeline stages)."""

    def __init__(self, config: TransformerConfig, post_process: bool = True,
                 num_layers: Optional[int] = None, layer_offset: int = 0):
        super().__init__()
        n = config.num_layers if num_layers is None else num_layers
        self.layers = torch.nn.ModuleList(
            [ParallelTransformerLayer(config, layer_offset + i) for i in range(n)])
        self.final_layernorm = _layer_norm(config) if post_process else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states


def sequence_parallel_params(model: torch.nn.Module) -> Iterable[torch.nn.Parameter]:
    """Parameters whose gradients are partial sums under sequence parallelism."""
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


def finalize_model_grads(model) -> None:
    """All-reduce, over the tensor-parallel group, the gradients of the parameters marked
    ``sequence_parallel`` (LayerNorms, row-parallel biases): Megatron's
    ``_allreduce_layernorm_grads``. One coalesced all-reduce; a no-op without sequence
    parallelism or at TP=1. Call it after backward, before clipping and the optimizer step.
    ``model`` is a module or a list of model chunks (pipeline stages)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    modules = list(model) if isinstance(model, (list, tuple)) else [model]
    params = [p for m in modules for p in sequence_parallel_params(m) if p.grad is not None]
    if not params:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    with comm.comm_tag("grads.sequence_parallel"):
        flat = comm.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n
