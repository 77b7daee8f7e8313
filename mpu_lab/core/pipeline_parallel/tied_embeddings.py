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

In a V schedule (ZB-V; Qi et al. 2024 §6) the first stage is chunk 0 and the last stage chunk 1
of pipeline rank 0: both copies live in one process, which adds the two gradients (and copies
the weight) itself, and the other end of the embedding group, rank ``p - 1``, holds neither.
Which chunk holds which end is read from Megatron's ``pre_process`` / ``post_process`` flags.
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


def _v_ends(model: ModelArg):
    """``(first, last)`` copies when this rank holds both ends in two chunks (a V), ``()`` when
    its chunks say they hold neither end, None when the chunks do not say (no flags) or the
    layout is the usual one."""
    chunks = [unwrap_model(c) for c in (model if isinstance(model, (list, tuple)) else [model])]
    if not all(hasattr(c, "pre_process") and hasattr(c, "post_process") for c in chunks):
        return None
    first = [c for c in chunks if c.pre_process]
    last = [c for c in chunks if c.post_process]
    if not first and not last:
        return ()
    if first and last and first[0] is not last[0]:
        return shared_embedding_or_output_weight(first[0]), shared_embedding_or_output_weight(last[0])
    return None


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
    v_ends = _v_ends(model) if ps.get_pipeline_model_parallel_world_size() > 1 else None
    if v_ends is not None:            # a V: both copies here (summed here), or neither
        total = sum(w.grad if w.grad is not None else torch.zeros_like(w) for w in v_ends)
        for w in v_ends:
            if w.grad is None:
                w.grad = total.clone()
            else:
                w.grad.copy_(total)
        return
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
    v_ends = _v_ends(model) if ps.get_pipeline_model_parallel_world_size() > 1 else None
    if v_ends is not None:
        if v_ends:
            with torch.no_grad():
                v_ends[1].copy_(v_ends[0])
        return
    weight = _weight_on_this_rank(model)
    if weight is None:
        return
    first = ps.get_group_ranks("embedding")[0]
    with torch.no_grad():
        weight.copy_(comm.broadcast(weight.detach(), src=first, group=ps.get_embedding_group()))
