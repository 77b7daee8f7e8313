"""Megatron-core's entry to Megatron-FSDP (``megatron/core/distributed/fsdp/mcore_fsdp_adapter.py``,
``FullyShardedDataParallel``, what ``--use-megatron-fsdp`` wraps the model in): a
:class:`~mpu_lab.core.distributed.fsdp.megatron_fsdp.MegatronFSDP` whose units are Megatron-core's
transformer layers unless told otherwise.

Megatron's adapter picks ``[TransformerLayer]`` for ``optim_grads_params`` and no unit for the
other strategies, whose gradient buffer it cuts into buckets instead; here the layers are the
units of ``optim_grads`` too, so each layer's reduce-scatter starts as soon as its backward is
done, as a bucket's would.
"""
from __future__ import annotations

from typing import Optional, Sequence, Type

import torch

from mpu_lab.core.distributed.fsdp.megatron_fsdp import MegatronFSDP
from mpu_lab.core.transformer.transformer_layer import TransformerLayer


class FullyShardedDataParallel(MegatronFSDP):
    """``MegatronFSDP(module, data_parallel_group, data_parallel_sharding_strategy,
    fsdp_unit_modules)`` with ``fsdp_unit_modules`` defaulting to ``(TransformerLayer,)``: one
    unit per layer, plus the root unit (embeddings, final LayerNorm, tied output layer). Pass
    ``(TransformerBlock,)`` for one unit holding every layer (fewer, larger all-gathers; a
    higher peak)."""

    def __init__(self, module: torch.nn.Module, data_parallel_group=None,
                 data_parallel_sharding_strategy: str = "optim_grads_params",
                 fsdp_unit_modules: Optional[Sequence[Type[torch.nn.Module]]] = None):
        super().__init__(module, data_parallel_group, data_parallel_sharding_strategy,
                         fsdp_unit_modules=(TransformerLayer,) if fsdp_unit_modules is None
                         else fsdp_unit_modules)
