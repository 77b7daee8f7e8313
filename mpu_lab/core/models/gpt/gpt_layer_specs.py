"""The GPT layer's spec, after Megatron-core's ``core/models/gpt/gpt_layer_specs.py``
(``get_gpt_layer_local_spec``): which classes build the transformer layer's parts, for a model
made of Megatron-core's own modules (no TransformerEngine).

    spec = get_gpt_layer_local_spec()
    model = GPTModel(config, vocab_size, max_sequence_length, transformer_layer_spec=spec)

A spec is data, so another set of linear layers is a change of four fields, not of the model's
code: ``get_gpt_layer_local_spec(column_parallel_linear=MyColumn, row_parallel_linear=MyRow)``
builds ``linear_qkv`` and ``linear_fc1`` from ``MyColumn``, ``linear_proj`` and ``linear_fc2``
from ``MyRow`` (Megatron-core's ``LocalSpecProvider`` / ``TESpecProvider`` pick the linear
classes the same way). The two classes take the keyword arguments of
:class:`~mpu_lab.core.tensor_parallel.ColumnParallelLinear` and
:class:`~mpu_lab.core.tensor_parallel.RowParallelLinear` and return ``(output, bias)``.
"""
from __future__ import annotations

from typing import Optional

from mpu_lab.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mpu_lab.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from mpu_lab.core.transformer.mlp import MLP, MLPSubmodules
from mpu_lab.core.transformer.moe import MoELayer
from mpu_lab.core.transformer.spec_utils import ModuleSpec
from mpu_lab.core.transformer.transformer_layer import (TransformerLayer,
                                                        TransformerLayerSubmodules)


def get_gpt_layer_local_spec(num_experts: Optional[int] = None,
                             column_parallel_linear: type = ColumnParallelLinear,
                             row_parallel_linear: type = RowParallelLinear) -> ModuleSpec:
    """The spec of one GPT layer: pre-LayerNorm self-attention (``linear_qkv`` column-,
    ``linear_proj`` row-parallel) and an MLP (``linear_fc1`` column-, ``linear_fc2``
    row-parallel), or with ``num_experts`` an MoE layer in the MLP's place (its experts build
    their own linears)."""
    attention = ModuleSpec(module=SelfAttention, submodules=SelfAttentionSubmodules(
        linear_qkv=column_parallel_linear, linear_proj=row_parallel_linear))
    if num_experts:
        mlp = ModuleSpec(module=MoELayer)
    else:
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=column_parallel_linear, linear_fc2=row_parallel_linear))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        self_attention=attention, mlp=mlp))
