"""The word embedding shared by the first and the last pipeline stage.

GPT ties its output layer to its input embedding (logits = h · Eᵀ). With pipelining the two
uses sit on different ranks: the first stage looks tokens up in ``E``, the last multiplies by
``E``. Megatron (Shoeybi et al. 2019 §3; Narayanan et al. 2021 §2.2) keeps a copy on each and
the *embedding group* (first and last rank of every pipeline) keeps the copies equal:

1. at start, the last stage's copy is made equal to the first's (:func:`sync_embedding_weights`);
2. after every backward, the two gradients are summed over the embedding group
   (:func:`allreduce_embedding_grads`, Megatron's ``_allreduce_word_embedding_grads``), so both
   copies take the same optimizer step — the gradient of the single tied matrix of the dense
   model is exactly that sum.

A model chunk exposes its copy through ``shared_embedding_or_output_weight()`` (Megatron's
name) or ``output_weight()`` (:class:`mpu_lab.core.models.gpt.GPTModel`'s).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from mpu_lab.core import comm
from mpu_lab.core import parallel_state as ps
from mpu_lab.core.pipeline_parallel.utils import unwrap_model

ModelArg = Union[torch.nn.Module, Sequence[torch.nn.Module]]


def shared_embedding_or_output_weight(model_chunk: torch.nn.Module) -> torch.nn.Parameter:
    """The chunk's copy of the tied embedding."""
    module = unwrap_model(model_chunk)
    for name in ("shared_embedding_or_output_weight", "output_weight"):
        if hasattr(module, name):
            return getattr(module, name)()
    raise AttributeError(f"{type(module).__name__} has neither shared_embedding_or_output_weight() "
                         f"nor output_weight(): cannot find the tied embedding")


def _weight_on_this_rank(model: ModelArg) -> Optional[torch.nn.Parameter]:
    """This rank's copy, or None when the rank holds none or the pipeline has one stage."""
    if ps.get_pipeline_model_parallel_world_size() == 1 or not ps.is_rank_in_embedding_group():
        return None
    chunks: List[torch.nn.Module] = list(model) if isinstance(model, (list, tuple)) else [model]
    # With virtual stages the embedding is in chunk 0 of the first rank and the output layer in
    # the last chunk of the last rank.
    chunk = chunks[0] if ps.is_pipeline_first_stage(ignore_virtual=True) else chunks[-1]
    return shared_embedding_or_output_weight(chunk)


def allreduce_embedding_grads(model: ModelArg) -> None:
    """Sum the tied embedding's gradient over the embedding group (first + last stage).

    Every rank may call it (others return at once); call it after the schedule's backward,
    before clipping and the optimizer step. A no-op with a single pipeline stage, where the
    tying is an ordinary shared parameter.
    """
    weight = _weight_on_this_rank(model)
    if weight is None:
        return
    grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    total = comm.all_reduce(grad, group=ps.get_embedding_group())
    if weight.grad is None:
        weight.grad = total
    else:
        weight.grad.copy_(total)


def sync_embedding_weights(model: ModelArg) -> None:
    """Copy the first stage's embedding into the last stage's output weight (at start or after
    loading a checkpoint that holds only one of them). Megatron zeroes the last stage's copy
    and all-reduces; a broadcast from the first stage is the same thing."""
    weight = _weight_on_this_rank(model)
    if weight is None:
        return
    first = ps.get_group_ranks("embedding")[0]
    with torch.no_grad():
        weight.copy_(comm.broadcast(weight.detach(), src=first, group=ps.get_embedding_group()))
