"""Broadcast a batch from the first rank of each tensor-parallel group to the others.

The ranks of one tensor-parallel group work on the *same* micro-batch (they split the model,
not the data), so Megatron lets only the group's first rank read the data loader and
broadcasts the batch. It costs two broadcasts, whatever the number of keys: first the shapes
(so the receivers can allocate), then every tensor flattened into one buffer.
"""
from __future__ import annotations

import itertools
import math
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch

from mpu_lab.core import comm, parallel_state, utils

_MAX_DATA_DIM = 5  # the most dimensions a broadcast tensor may have (a 0 ends a shape)


def _check_data_types(keys: Sequence, data: Mapping, target_dtype: torch.dtype) -> None:
    for key in keys:
        if data[key].dtype != target_dtype:
            raise TypeError(f"broadcast_data: {key!r} has dtype {data[key].dtype}, "
                            f"expected {target_dtype}")


def _build_key_size_numel_dictionaries(keys: Sequence, data: Optional[Mapping]
                                       ) -> Tuple[Dict, Dict, int]:
    """Shapes of ``data[key]`` on the source rank, broadcast to the group as one int64 tensor of
    ``_MAX_DATA_DIM`` slots per key, 0-padded (so a dimension of size 0 cannot be sent)."""
    group = parallel_state.get_tensor_model_parallel_group()
    src = parallel_state.get_tensor_model_parallel_src_rank()
    sizes = [0] * (_MAX_DATA_DIM * len(keys))
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        for i, key in enumerate(keys):
            shape = data[key].shape
            if len(shape) > _MAX_DATA_DIM:
                raise ValueError(f"broadcast_data: {key!r} has {len(shape)} dimensions, "
                                 f"at most {_MAX_DATA_DIM} are supported")
            if 0 in shape:
                raise ValueError(f"broadcast_data: {key!r} has an empty dimension {tuple(shape)}")
            sizes[i * _MAX_DATA_DIM:i * _MAX_DATA_DIM + len(shape)] = list(shape)
    sizes_tensor = torch.tensor(sizes, dtype=torch.long, device=utils.get_device())
    sizes_tensor = comm.broadcast(sizes_tensor, src, group=group).cpu().tolist()

    key_size, key_numel = {}, {}
    for i, key in enumerate(keys):
        slots = sizes_tensor[i * _MAX_DATA_DIM:(i + 1) * _MAX_DATA_DIM]
        key_size[key] = list(itertools.takewhile(bool, slots))      # a 0 ends the shape
        key_numel[key] = math.prod(key_size[key])
    return key_size, key_numel, sum(key_numel.values())


def broadcast_data(keys: Sequence, data: Optional[Mapping], datatype: torch.dtype
                   ) -> Dict[object, torch.Tensor]:
    """``{key: data[key]}`` from the tensor-parallel source rank, on every rank of its group.

    Only the source rank (the first rank of the group) reads ``data``; the others may pass
    ``None``. Every ``data[key]`` must have dtype ``datatype``. The tensors come back on this
    rank's device (:func:`mpu_lab.core.utils.get_device`).
    """
    is_src = parallel_state.get_tensor_model_parallel_rank() == 0
    if is_src:
        _check_data_types(keys, data, datatype)  # before any communication
    key_size, key_numel, total_numel = _build_key_size_numel_dictionaries(keys, data)
    group = parallel_state.get_tensor_model_parallel_group()
    src = parallel_state.get_tensor_model_parallel_src_rank()
    device = utils.get_device()

    if is_src:
        flat = torch.cat([data[key].contiguous().view(-1) for key in keys]).to(device)
    else:
        flat = torch.empty(total_numel, dtype=datatype, device=device)
    flat = comm.broadcast(flat, src, group=group)                 # [sum of numels]

    output, offset = {}, 0
    for key in keys:
        numel = key_numel[key]
        output[key] = flat.narrow(0, offset, numel).view(key_size[key])
        offset += numel
    return output
