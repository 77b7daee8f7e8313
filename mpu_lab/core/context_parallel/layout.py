"""Megatron's load-balanced sequence layout for context parallelism.

With a causal mask, token ``t`` attends to the ``t + 1`` tokens before it, so the last part of
a sequence costs far more attention than the first. Cut the sequence into ``cp`` slices and
the last rank does almost all of the work. Megatron cuts it into ``2 * cp`` chunks instead and
gives rank ``r`` chunks ``r`` and ``2 * cp - 1 - r``: one cheap chunk from the front and one
expensive chunk from the back, so every rank gets the same causal work (the "zig-zag" layout).
For s = 16 and cp = 2 the chunks are 4 tokens long: rank 0 keeps positions 0-3 and 12-15,
rank 1 keeps 4-11.

Mirrors ``get_batch_on_this_cp_rank`` (megatron/training/utils.py; megatron/core/utils.py in
Megatron-core) and the chunk reordering that TransformerEngine's context-parallel attention
and Megatron-core's ``ssm/mamba_context_parallel.py`` (``_undo_attention_load_balancing`` /
``_redo_attention_load_balancing``) do when a rank needs the whole sequence in natural order.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from mpu_lab.core import parallel_state
from mpu_lab.core.utils import nearest_multiples


def chunk_ids(cp_rank: int, cp_size: int) -> Tuple[int, int]:
    """The two chunks (of ``2 * cp_size``) that CP rank ``cp_rank`` holds, in its order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def check_sequence_length(seq_length: int, cp_size: int, what: str = "sequence length") -> None:
    """``ValueError`` unless ``seq_length`` splits into ``2 * cp_size`` equal chunks."""
    if seq_length % (2 * cp_size):
        step = 2 * cp_size
        nearest = nearest_multiples(seq_length, step)
        raise ValueError(
            f"{what} s={seq_length} is not divisible by 2*cp = {step} (cp={cp_size}): context "
            f"parallelism cuts the sequence into 2*cp equal chunks; use a multiple of {step}, "
            f"e.g. {nearest}")


def positions_on_rank(seq_length: int, cp_rank: int, cp_size: int) -> List[int]:
    """The sequence positions CP rank ``cp_rank`` holds, in its order (chunk r, then chunk
    2*cp-1-r). For s=16, cp=2: rank 0 -> [0..3, 12..15], rank 1 -> [4..11]."""
    check_sequence_length(seq_length, cp_size)
    chunk = seq_length // (2 * cp_size)
    return [c * chunk + i for c in chunk_ids(cp_rank, cp_size) for i in range(chunk)]


def _cp_rank_and_size(cp_group) -> Tuple[int, int]:
    if cp_group is not None:
        return dist.get_rank(group=cp_group), dist.get_world_size(group=cp_group)
    return (parallel_state.get_context_parallel_rank(),
            parallel_state.get_context_parallel_world_size())


def get_batch_on_this_cp_rank(batch: Dict[str, Any], cp_group=None) -> Dict[str, Any]:
    """This CP rank's part of ``batch``: chunks ``r`` and ``2*cp-1-r`` of ``2*cp`` along the
    sequence, in that order (Megatron's ``get_batch_on_this_cp_rank``).

    ``batch`` maps names to ``[b, s, ...]`` tensors (tokens, labels, loss_mask, position_ids):
    the sequence is dim 1, except for ``attention_mask`` (``[b, 1, s, s]``), whose dim 2 is cut,
    as in Megatron. ``None`` values pass through. The CP rank and size come from ``cp_group``
    or, when it is None, from :mod:`mpu_lab.core.parallel_state`'s CP group. With cp = 1 the batch
    comes back as it is. Every length is checked before anything is cut; a new dict is returned
    (Megatron overwrites the entries of the one it is given and returns it).
    """
    cp_rank, cp_size = _cp_rank_and_size(cp_group)
    if cp_size == 1:
        return dict(batch)
    seq_dims = {}
    for key, val in batch.items():
        if val is None:
            continue
        seq_dim = 2 if key == "attention_mask" else 1
        if not torch.is_tensor(val) or val.dim() <= seq_dim:
            shape = tuple(val.shape) if torch.is_tensor(val) else type(val).__name__
            raise ValueError(f"get_batch_on_this_cp_rank: batch[{key!r}] must be a tensor with a "
                             f"sequence dim {seq_dim}, got {shape}")
        check_sequence_length(val.size(seq_dim), cp_size, f"batch[{key!r}]: sequence length")
        seq_dims[key] = seq_dim

    out = dict(batch)
    for key, seq_dim in seq_dims.items():
        val = batch[key]
        chunk = val.size(seq_dim) // (2 * cp_size)
        # [.., s, ..] -> [.., 2*cp, s/(2*cp), ..]: pick this rank's two chunks, then flatten back
        chunks = val.view(*val.shape[:seq_dim], 2 * cp_size, chunk, *val.shape[seq_dim + 1:])
        index = torch.tensor(chunk_ids(cp_rank, cp_size), device=val.device)
        mine = chunks.index_select(seq_dim, index)
        out[key] = mine.reshape(*val.shape[:seq_dim], 2 * chunk, *val.shape[seq_dim + 1:])
    return out


def natural_to_rank_order(cp_size: int, seq_length: int, device=None) -> torch.Tensor:
    """Index that lays a sequence in natural order out the way the CP ranks hold it, rank 0's two
    chunks first, then rank 1's, ...: ``gathered = natural[index]`` (Megatron-core's
    ``_redo_attention_load_balancing``). For s = 8, cp = 2: [0, 1, 6, 7, 2, 3, 4, 5]."""
    return torch.tensor([p for r in range(cp_size) for p in positions_on_rank(seq_length, r, cp_size)],
                        device=device)


def rank_order_to_natural(cp_size: int, seq_length: int, device=None) -> torch.Tensor:
    """The inverse of :func:`natural_to_rank_order`: a sequence gathered from the CP ranks in rank
    order back in natural order, ``natural = gathered[index]`` (Megatron-core's
    ``_undo_attention_load_balancing``). For s = 8, cp = 2: [0, 1, 4, 5, 6, 7, 2, 3]."""
    return torch.argsort(natural_to_rank_order(cp_size, seq_length, device))


def sequence_positions(seq_length: int, cp_group=None, device=None) -> torch.Tensor:
    """The positions this CP rank's ``seq_length / cp`` tokens have in the whole sequence of
    ``seq_length`` (what its position ids become after the layout)."""
    cp_rank, cp_size = _cp_rank_and_size(cp_group)
    return torch.tensor(positions_on_rank(seq_length, cp_rank, cp_size), device=device)


def optional_group(group: Optional[Any]):
    """``group``, or the CP group of :mod:`mpu_lab.core.parallel_state` when it is None."""
    return parallel_state.get_context_parallel_group() if group is None else group
