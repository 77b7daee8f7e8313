"""GPT, after Megatron-core's ``core/models/gpt/``: :class:`GPTModel` (``gpt_model.py``)."""
from mpu_lab.core.models.gpt.gpt_model import (
    GPTModel, LanguageModelEmbedding, build_model_chunks, pad_vocab_size)

__all__ = ["GPTModel", "LanguageModelEmbedding", "build_model_chunks", "pad_vocab_size"]
