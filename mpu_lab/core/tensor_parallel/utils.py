"""Small helpers of tensor parallelism: sizes that must divide, tensor splits, vocab ranges.

Megatron-core's ``tensor_parallel/utils.py``. The 1-D chunk helpers spread an activation every
tensor-parallel rank holds in full over the group (each keeps ``1/t``) and put it back together.
"""
from __future__ import annotations

from typing import Tuple

import torch

from mpu_lab.core import comm, parallel_state


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Raise ``ValueError`` naming both numbers unless ``denominator`` divides ``numerator``."""
    if denominator == 0 or numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``, after checking that the division is exact."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> Tuple[torch.Tensor, ...]:
    """Split ``tensor`` into ``num_partitions`` equal pieces along its last dimension: views,
    or contiguous copies (which the collectives need) with ``contiguous_split_chunks``."""
    last_dim = tensor.dim() - 1
    chunk = divide(tensor.size(last_dim), num_partitions)
    pieces = torch.split(tensor, chunk, dim=last_dim)
    if contiguous_split_chunks:
        return tuple(p.contiguous() for p in pieces)
    return pieces


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, new_buffer: bool = False) -> torch.Tensor:
    """This tensor-parallel rank's chunk of the flattened ``tensor``.

    Rank ``r`` of a group of ``t`` keeps elements ``[r*n/t, (r+1)*n/t)`` of the ``n`` flattened
    elements: a view, or a copy with ``new_buffer=True``.
    """
    world = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    per_rank = divide(tensor.numel(), world)
    flat = tensor.reshape(-1)  # a view when the tensor is contiguous
    mine = flat[rank * per_rank:(rank + 1) * per_rank]
    return mine.clone() if new_buffer else mine


def gather_split_1d_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_tensor_into_1d_equal_chunks`: all-gather the flattened chunks of
    the tensor-parallel group, in group-rank order, into one 1-D tensor of ``t * numel`` elements.

    Megatron's unit test (tp=2): each rank holds a (2, 4) tensor filled with its rank; the
    result on ranks 0 and 1 is eight 0s followed by eight 1s.
    """
    group = parallel_state.get_tensor_model_parallel_group()
    return comm.all_gather(tensor.reshape(-1), group=group, dim=0)


class VocabUtility:
    """Which rows ``[first, last)`` of the vocabulary a tensor-parallel rank owns: the embedding
    table (and the output logits) is split in contiguous blocks, rank ``r`` owns
    ``[r * V/t, (r + 1) * V/t)``."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> Tuple[int, int]:
        # world_size is unused; the argument is kept so call sites read as in Megatron.
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int,
                                           world_size: int) -> Tuple[int, int]:
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)
