"""Models built from the transformer, after Megatron-core's ``core/models/``: ``gpt``."""
