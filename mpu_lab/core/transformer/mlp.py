"""The tensor-parallel MLP block, :class:`MLP` (Megatron-core's ``core/transformer/mlp.py``,
class ``MLP``; Megatron's legacy code calls it ``ParallelMLP``) — Shoeybi et al. 2019, §3,
Fig. 3a.

    x' = act(x W^1) W^2          W^1: D x F split by columns, W^2: F x D split by rows

Rank ``i`` of ``t`` holds ``W^1_i`` (``D x F/t``) and ``W^2_i`` (``F/t x D``), computes
``act(x W^1_i) W^2_i`` — a partial sum — and one all-reduce (``g``) adds the ``t`` partial
sums. The activation is elementwise, so it needs no communication: that is why ``W^1`` is
split by columns and not by rows. In the lecture's table (``F = 4D``):

    A  = Out W^1     [B, L, 4D/d_tp]
    A' = relu(A)     [B, L, 4D/d_tp]
    x' = A' W^2      [B, L, D]        then AllReduce(x')

Tensors here are sequence-first, ``[s, b, h]`` (Megatron's layout; with sequence parallelism
the input and output are this rank's ``[s/t, b, h]``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from mpu_lab.core.transformer.spec_utils import ModuleSpec, build_module
from mpu_lab.core.transformer.transformer_config import ACTIVATIONS, TransformerConfig
from mpu_lab.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear


@dataclasses.dataclass
class MLPSubmodules:
    """The classes (or specs) that build the MLP's two linear layers (Megatron-core's
    ``MLPSubmodules``): ``linear_fc1`` column-parallel, ``linear_fc2`` row-parallel."""

    linear_fc1: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_fc2: Union[ModuleSpec, type] = RowParallelLinear


class MLP(torch.nn.Module):
    """``h -> ffn_hidden_size -> h`` with column-parallel ``linear_fc1`` and row-parallel
    ``linear_fc2``. ``forward`` returns ``(output, bias)``: the second layer's bias is not
    added (``skip_bias_add``) so the caller adds it together with dropout and the residual,
    as Megatron's bias-dropout-add does."""

    def __init__(self, config: TransformerConfig, submodules: Optional[MLPSubmodules] = None):
        super().__init__()
        submodules = submodules if submodules is not None else MLPSubmodules()
        if config.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, "
                             f"got {config.activation!r}")
        self.activation = ACTIVATIONS[config.activation]
        self.linear_fc1 = build_module(
            submodules.linear_fc1, config.hidden_size, config.ffn_hidden_size, bias=True,
            gather_output=False, init_method=config.init_method(),
            sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype)
        self.linear_fc2 = build_module(
            submodules.linear_fc2, config.ffn_hidden_size, config.hidden_size, bias=True,
            input_is_parallel=True, init_method=config.output_layer_init_method(),
            skip_bias_add=True, sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype)

    def forward(self, hidden_states: torch.Tensor):
        # hidden_states: [s, b, h] (or [s/t, b, h] with sequence parallelism)
        a, _ = self.linear_fc1(hidden_states)           # A  = x W^1: [s, b, ffn/t]
        a = self.activation(a)                          # A' = act(A): [s, b, ffn/t]
        out, bias = self.linear_fc2(a)                  # x' = A' W^2, all-reduced: [s, b, h]
        return out, bias
