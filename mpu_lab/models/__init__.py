"""Parallel transformer models, named after Megatron-core's ``megatron/core/transformer`` and
``megatron/core/models/gpt`` (docs/ARCHITECTURE.md lists the legacy names of
``megatron/legacy/model``, for reading old code).

* :class:`MLP`, :class:`SelfAttention` — the two tensor-parallel blocks (Shoeybi et al.
  2019, §3, Fig. 3);
* :class:`TransformerLayer`, :class:`TransformerBlock` — pre-LN layers, optionally
  sequence-parallel (Korthikanti et al. 2022), configured by :class:`TransformerConfig`;
* :class:`GPTModel` — vocab-parallel embedding, layers, tied vocab-parallel output and loss;
  :func:`build_model_chunks` — one pipeline rank's stages of it, with the one-stage weights;
  :class:`PlainGPT` — its single-process ``torch.nn`` twin with the same parameter names;
* :mod:`mpu_lab.models.introspection` — the lecture's shape table, read off a layer's forward
  from outside (hooks; the blocks carry no recording).
"""
from mpu_lab.models.attention import SelfAttention
from mpu_lab.models.gpt import (
    GPTModel,
    LanguageModelEmbedding,
    PlainGPT,
    build_model_chunks,
    pad_vocab_size,
)
from mpu_lab.models.introspection import (
    format_shape_table,
    lecture_shapes,
    shape_table,
)
from mpu_lab.models.mlp import MLP
from mpu_lab.models.transformer import (
    TransformerBlock,
    TransformerConfig,
    TransformerLayer,
    finalize_model_grads,
)

__all__ = [
    "lecture_shapes",
    "TransformerConfig", "MLP", "SelfAttention", "TransformerLayer", "TransformerBlock",
    "GPTModel", "LanguageModelEmbedding", "PlainGPT", "build_model_chunks", "pad_vocab_size",
    "finalize_model_grads", "shape_table", "format_shape_table",
]
