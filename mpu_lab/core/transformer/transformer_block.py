"""The stack of transformer layers: :class:`TransformerBlock` (Megatron-core's
``core/transformer/transformer_block.py``; ``ParallelTransformer`` in Megatron's legacy code),
with full activation recomputation (Korthikanti et al. 2022, §5; Megatron-core's
``_checkpointed_forward``): with ``recompute_granularity="full"`` only the input of a group of
layers is kept in forward, and backward runs the group's forward again.

* ``recompute_method="uniform"``: the block's layers in groups of ``recompute_num_layers``,
  each group one checkpoint (its input kept, everything inside recomputed);
* ``recompute_method="block"``: the first ``recompute_num_layers`` layers of the block (this
  pipeline stage, or this virtual stage), each its own checkpoint; the rest keep everything.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from mpu_lab.core.tensor_parallel import checkpoint
from mpu_lab.core.transformer.spec_utils import ModuleSpec, build_module
from mpu_lab.core.transformer.transformer_config import TransformerConfig
from mpu_lab.core.transformer.transformer_layer import TransformerLayer, build_layer_norm
from mpu_lab.core.utils import make_viewless_tensor


class TransformerBlock(torch.nn.Module):
    """A stack of layers plus the final LayerNorm when ``post_process`` (the last pipeline
    stage). ``layer_offset`` numbers this stage's layers globally (pipeline stages). ``spec``:
    the layer's :class:`~mpu_lab.core.transformer.spec_utils.ModuleSpec` (Megatron-core's
    ``spec`` argument, second there; default :class:`TransformerLayer` with its default
    submodules)."""

    def __init__(self, config: TransformerConfig, post_process: bool = True,
                 num_layers: Optional[int] = None, layer_offset: int = 0,
                 spec: Optional[Union[ModuleSpec, type]] = None):
        super().__init__()
        self.config = config
        spec = spec if spec is not None else ModuleSpec(module=TransformerLayer)
        n = config.num_layers if num_layers is None else num_layers
        self.layers = torch.nn.ModuleList(
            [build_module(spec, config, layer_offset + i) for i in range(n)])
        self.final_layernorm = build_layer_norm(config) if post_process else None

    def _layers_forward(self, start: int, end: int):
        """Megatron's ``custom(start, end)``: the forward of layers ``[start, end)``."""
        def custom_forward(hidden_states):
            for layer in self.layers[start:end]:
                hidden_states = layer(hidden_states)
            return hidden_states
        return custom_forward

    def _checkpointed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Full recomputation: which groups of layers keep only their input."""
        config, n = self.config, len(self.layers)
        step = config.recompute_num_layers

        def checkpointed(start, end, hidden_states):
            if config.distribute_saved_activations:      # its storage is swapped: no view
                hidden_states = make_viewless_tensor(hidden_states)
            return checkpoint(self._layers_forward(start, end),
                              config.distribute_saved_activations, hidden_states)

        if config.recompute_method == "uniform":
            for start in range(0, n, step):
                hidden_states = checkpointed(start, min(start + step, n), hidden_states)
        else:                                            # "block"
            for index in range(n):
                if index < step:
                    hidden_states = checkpointed(index, index + 1, hidden_states)
                else:
                    hidden_states = self._layers_forward(index, index + 1)(hidden_states)
        return hidden_states

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.config.recompute_granularity == "full" and self.training:
            hidden_states = self._checkpointed_forward(hidden_states)
        else:
            hidden_states = self._layers_forward(0, len(self.layers))(hidden_states)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
