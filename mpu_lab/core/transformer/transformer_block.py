"""The stack of transformer layers: :class:`TransformerBlock` (Megatron-core's
``core/transformer/transformer_block.py``; ``ParallelTransformer`` in Megatron's legacy code)."""
from __future__ import annotations

from typing import Optional

import torch

from mpu_lab.core.transformer.transformer_config import TransformerConfig
from mpu_lab.core.transformer.transformer_layer import TransformerLayer, build_layer_norm


class TransformerBlock(torch.nn.Module):
    """A stack of layers plus the final LayerNorm when ``post_process`` (the last pipeline
    stage). ``layer_offset`` numbers this stage's layers globally (pipeline stages)."""

    def __init__(self, config: TransformerConfig, post_process: bool = True,
                 num_layers: Optional[int] = None, layer_offset: int = 0):
        super().__init__()
        n = config.num_layers if num_layers is None else num_layers
        self.layers = torch.nn.ModuleList(
            [TransformerLayer(config, layer_offset + i) for i in range(n)])
        self.final_layernorm = build_layer_norm(config) if post_process else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
