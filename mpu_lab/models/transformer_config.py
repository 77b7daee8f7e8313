"""The model's shape and options, :class:`TransformerConfig` (a subset of Megatron-core's
``core/transformer/transformer_config.py``), with its pure checks — ``ValueError`` naming the
numbers when a shape cannot be split ``t`` ways — and Megatron's init methods; and
:data:`ACTIVATIONS`, the MLP's activation functions by name. It imports nothing from
:mod:`mpu_lab.models`, so the blocks can all import it."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from mpu_lab.utils import divisors

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}


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
