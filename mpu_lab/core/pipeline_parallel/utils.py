"""What a schedule needs to know about the model it runs: the module inside a wrapper, this
rank's model chunks and their data iterators (checked against the schedule), and the shape and
dtype of the messages between stages (Megatron-core's ``core/utils.py``:
``get_attr_wrapped_model`` / ``get_model_config``, and the tensor shapes of
``core/pipeline_parallel/schedules.py``)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from mpu_lab.core import parallel_state as ps
from mpu_lab.core.pipeline_parallel.partition import check_schedule


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP-style wrappers (``.module``), where ``set_input_tensor`` lives."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def model_chunks_of(model) -> List[torch.nn.Module]:
    """``[model]``, or the chunks of a list / ``ModuleList`` of pipeline model chunks (the
    one place that says what a "model" argument may be: a module or this rank's chunks)."""
    if isinstance(model, (list, tuple, torch.nn.ModuleList)):
        return list(model)
    return [model]


def get_model_config(model_chunk: torch.nn.Module):
    """The chunk's ``config`` (a ``TransformerConfig``, or any object with ``hidden_size``),
    looked up through wrappers; ``None`` when it has none."""
    return getattr(unwrap_model(model_chunk), "config", None)


def get_tensor_shape(model_chunk: torch.nn.Module, seq_length: int,
                     micro_batch_size: int) -> Tuple[int, int, int]:
    """``(s, b, h)`` of the activations between stages, from ``model.config.hidden_size``
    (``s/t`` with sequence parallelism: each tensor-parallel rank holds its block of tokens)."""
    config = get_model_config(model_chunk)
    hidden = getattr(config, "hidden_size", None)
    if hidden is None:
        raise ValueError("cannot tell the hidden size of the messages between stages: give the "
                         "model chunk a .config with hidden_size, or pass tensor_shape=(s, b, h)")
    s = seq_length
    if getattr(config, "sequence_parallel", False):
        s //= ps.get_tensor_model_parallel_world_size()
    return (s, micro_batch_size, hidden)


def get_pipeline_dtype(model_chunk: torch.nn.Module) -> torch.dtype:
    """dtype of the messages between stages: ``config.pipeline_dtype``, else
    ``config.params_dtype``, else fp32."""
    config = get_model_config(model_chunk)
    return getattr(config, "pipeline_dtype", None) or getattr(config, "params_dtype", None) \
        or torch.float32


def chunks_and_iterators(schedule: str, model, data_iterator, num_microbatches: int):
    """This rank's model chunks and one data iterator per chunk, for ``schedule``; raises
    ``ValueError`` on arguments that cannot run."""
    chunks = model_chunks_of(model)
    v = len(chunks)
    check_schedule(schedule, ps.get_pipeline_model_parallel_world_size(), num_microbatches, v)
    declared = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    if declared != v:
        # is_pipeline_first_stage()/last_stage() consult the declared size.
        raise ValueError(f"{v} model chunk(s) given, but initialize_model_parallel was called with "
                         f"virtual_pipeline_model_parallel_size "
                         f"{ps.get_virtual_pipeline_model_parallel_world_size()}; they must agree")
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != v:
            raise ValueError(f"{len(data_iterator)} data iterators for {v} model chunks")
        return chunks, list(data_iterator)
    if v > 1:
        raise ValueError(f"the interleaved schedule needs one data iterator per model chunk "
                         f"(a list of {v}), as in Megatron")
    return chunks, [data_iterator]


def message_shape_and_dtype(model_chunk: torch.nn.Module, seq_length: int, micro_batch_size: int,
                            tensor_shape: Optional[Sequence[int]] = None,
                            dtype: Optional[torch.dtype] = None):
    """``(shape, dtype)`` of the messages between stages: the given ones, else
    :func:`get_tensor_shape` and :func:`get_pipeline_dtype` of the chunk."""
    shape = tuple(tensor_shape) if tensor_shape is not None else \
        get_tensor_shape(model_chunk, seq_length, micro_batch_size)
    return shape, dtype or get_pipeline_dtype(model_chunk)
