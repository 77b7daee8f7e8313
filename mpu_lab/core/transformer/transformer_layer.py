"""The transformer layer, tensor- and sequence-parallel: :class:`TransformerLayer`
(Megatron-core's ``core/transformer/transformer_layer.py``; ``ParallelTransformerLayer`` in
Megatron's legacy code). The stack of layers is in :mod:`.transformer_block`.

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
parameters' gradients are partial sums: ``allreduce_sequence_parallel_grads``
(core/distributed/finalize_model_grads.py) all-reduces them over the
tensor-parallel group before the optimizer step. Dropout on different tokens must draw
different masks: it runs inside ``get_rng_tracker().fork()``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional, Union

import torch
import torch.nn.functional as F

from mpu_lab.core.utils import get_device
from mpu_lab.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from mpu_lab.core.transformer.mlp import MLP, MLPSubmodules
from mpu_lab.core.transformer.moe import MoELayer
from mpu_lab.core.transformer.spec_utils import ModuleSpec, build_module
from mpu_lab.core.transformer.transformer_config import TransformerConfig
from mpu_lab.core.tensor_parallel import checkpoint, get_rng_tracker


def build_layer_norm(config: TransformerConfig) -> torch.nn.LayerNorm:
    norm = torch.nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon,
                              device=get_device(), dtype=config.params_dtype)
    for p in norm.parameters():
        # Replicated on the tensor-parallel group; with sequence parallelism each rank sees
        # other tokens, so its gradient must be all-reduced (finalize_model_grads.py).
        p.sequence_parallel = config.sequence_parallel
    return norm


def _hidden_dropout_context(config: TransformerConfig, training: bool):
    """Where dropout outside the tensor-parallel blocks draws its mask: the default generator
    (the same mask on every rank of the group, which holds the same tokens), or with sequence
    parallelism the tensor-parallel stream (each rank holds other tokens)."""
    if training and config.hidden_dropout > 0 and config.sequence_parallel:
        return get_rng_tracker().fork()
    return contextlib.nullcontext()


@dataclasses.dataclass
class TransformerLayerSubmodules:
    """The specs of the layer's two blocks (Megatron-core's ``TransformerLayerSubmodules``,
    without the LayerNorm and bias-dropout-add fields: those are always torch's LayerNorm and
    this layer's own bias-dropout-add). ``mlp=None``: the dense :class:`MLP`, or an
    :class:`~mpu_lab.core.transformer.moe.MoELayer` when ``config.num_moe_experts`` is set."""

    self_attention: Union[ModuleSpec, type] = dataclasses.field(
        default_factory=lambda: ModuleSpec(module=SelfAttention,
                                           submodules=SelfAttentionSubmodules()))
    mlp: Optional[Union[ModuleSpec, type]] = None


def default_mlp_spec(config: TransformerConfig) -> ModuleSpec:
    """The MLP of Megatron-core's local spec: the dense MLP, or with ``num_moe_experts`` the
    MoE layer (it returns ``(output, None)``, no bias to add)."""
    if config.num_moe_experts:
        return ModuleSpec(module=MoELayer)
    return ModuleSpec(module=MLP, submodules=MLPSubmodules())


class TransformerLayer(torch.nn.Module):
    """Pre-LN GPT layer: ``x + attn(LN(x))`` then ``x + mlp(LN(x))``; ``[s, b, h]`` in and out
    (``[s/t, b, h]`` with sequence parallelism). ``layer_number`` (0-based) numbers the layer
    across pipeline stages. ``submodules`` (:class:`TransformerLayerSubmodules`, default: the
    blocks of :func:`~mpu_lab.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec`) says
    which classes build the attention and the MLP; Megatron-core passes it second, here it is a
    keyword after ``layer_number`` so that ``TransformerLayer(config, n)`` keeps working."""

    def __init__(self, config: TransformerConfig, layer_number: int = 0,
                 submodules: Optional[TransformerLayerSubmodules] = None):
        super().__init__()
        submodules = submodules if submodules is not None else TransformerLayerSubmodules()
        self.config = config
        self.layer_number = layer_number
        self.input_layernorm = build_layer_norm(config)
        self.self_attention = build_module(submodules.self_attention, config)
        self.pre_mlp_layernorm = build_layer_norm(config)
        mlp_spec = submodules.mlp if submodules.mlp is not None else default_mlp_spec(config)
        self.mlp = build_module(mlp_spec, config)
        # selective recomputation of the dense MLP (Megatron-core's recompute_modules "mlp")
        self.recompute_mlp = (config.recompute_granularity == "selective"
                              and "mlp" in config.recompute_modules and not config.num_moe_experts)

    def _bias_dropout_add(self, x, bias, residual):
        if bias is not None:
            x = x + bias
        if self.training and self.config.hidden_dropout > 0:
            with _hidden_dropout_context(self.config, self.training):
                x = F.dropout(x, p=self.config.hidden_dropout, training=True)
        return residual + x

    def _mlp_with_bias(self, ln):
        """The MLP with its bias added (a checkpoint returns tensors made inside it only)."""
        out, bias = self.mlp(ln)
        return out if bias is None else out + bias

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        ln = self.input_layernorm(hidden_states)
        attn, attn_bias = self.self_attention(ln)
        hidden_states = self._bias_dropout_add(attn, attn_bias, hidden_states)
        ln = self.pre_mlp_layernorm(hidden_states)
        if self.recompute_mlp and self.training:
            mlp, mlp_bias = checkpoint(self._mlp_with_bias, False, ln), None
        else:
            mlp, mlp_bias = self.mlp(ln)
        hidden_states = self._bias_dropout_add(mlp, mlp_bias, hidden_states)
        return hidden_states
