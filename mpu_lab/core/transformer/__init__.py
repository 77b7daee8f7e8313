"""The transformer, after Megatron-core's ``core/transformer/``: :class:`TransformerConfig`
(``transformer_config.py``), :class:`TransformerLayer` (``transformer_layer.py``),
:class:`TransformerBlock` (``transformer_block.py``), the tensor-parallel blocks
:class:`SelfAttention` (``attention.py``) and :class:`MLP` (``mlp.py``) (Shoeybi et al. 2019,
§3, Fig. 3), and mixture of experts in ``moe/``."""
from mpu_lab.core.transformer.attention import SelfAttention
from mpu_lab.core.transformer.mlp import MLP
from mpu_lab.core.transformer.transformer_block import TransformerBlock
from mpu_lab.core.transformer.transformer_config import TransformerConfig
from mpu_lab.core.transformer.transformer_layer import TransformerLayer

__all__ = ["TransformerConfig", "TransformerLayer", "TransformerBlock", "SelfAttention", "MLP"]
