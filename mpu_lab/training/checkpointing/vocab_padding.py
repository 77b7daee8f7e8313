"""A change of vocabulary padding across a resume: the rows of the embedding table (and of an
untied output layer, and their Adam moments) that are dummies are trimmed or added as zeros.

Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x TP``
(``_vocab_size_with_padding`` in ``megatron/training/tokenizer/tokenizer.py``; here
:func:`mpu_lab.core.models.gpt.pad_vocab_size`), so every tensor-parallel rank holds as many whole rows.
The padded size therefore depends on TP: 512 ids pad to 512 at TP = 2 but to 1024 at TP = 8.
Rows ``[vocab_size, padded)`` are dummy ids that no data ever uses. Loading a checkpoint at a
TP size with another padding keeps every real row, keeps the saved dummy rows that still fit,
drops those past the new end (trim) and fills the new ones with zeros (extend), the Adam
moments alike. Megatron's checkpoint converters (``tools/checkpoint``, ``pad_weight`` in the
savers) trim the same way but extend by repeating the last row; a zero row instead gives each
new dummy id a logit of exactly 0 whatever the input, and zero moments.

What does not carry over exactly: Megatron's loss is a softmax over the *padded* vocabulary,
so the dummy logits are in its denominator. The logits of the real ids are unchanged, but a
new dummy id (logit 0) takes a share of the probability and a trimmed one gives its share
back: the loss over the padded vocabulary moves at the resume by
``log(sum of exp(new logits) / sum of exp(saved logits))`` per token, and training then pushes
the new dummies down as it did the old ones.

Pure: ``torch`` tensors only, no ``torch.distributed``. :func:`load_checkpoint
<mpu_lab.training.checkpointing.save_load.load_checkpoint>` uses it on every rank.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from mpu_lab.training.checkpointing.state_dict import TIED_EMBEDDING

# Parameters whose rows are vocabulary ids (split along dim 0 over the tensor-parallel group).
VOCAB_PADDED = (TIED_EMBEDDING, "output_layer_weight")
_OPTIMIZER_SUFFIXES = (".exp_avg", ".exp_avg_sq")


def parameter_name(key: str) -> str:
    """The parameter a checkpoint key belongs to: ``model.<name>`` or
    ``optimizer.<name>.exp_avg[_sq]`` -> ``<name>``."""
    if key.startswith("model."):
        return key[len("model."):]
    if key.startswith("optimizer."):
        name = key[len("optimizer."):]
        for suffix in _OPTIMIZER_SUFFIXES:
            if name.endswith(suffix):
                return name[:-len(suffix)]
        return name
    return key


def is_vocab_padded(key: str) -> bool:
    """Whether the rows of the checkpoint entry ``key`` are vocabulary ids."""
    return parameter_name(key) in VOCAB_PADDED


def can_repad(key: str, saved_shape: Sequence[int], shape: Sequence[int],
              vocab_size: Optional[int]) -> bool:
    """Whether ``key`` saved as ``saved_shape`` can be loaded as ``shape`` by trimming or
    adding dummy rows: a vocabulary table, only the row count differs, and both hold every one
    of the ``vocab_size`` real rows (``None``: the checkpoint did not record it, so no)."""
    return (vocab_size is not None and is_vocab_padded(key) and len(saved_shape) == len(shape)
            and tuple(saved_shape[1:]) == tuple(shape[1:])
            and min(saved_shape[0], shape[0]) >= vocab_size)


def repadded_rows(saved: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of the re-padded table: those ``saved`` (the whole saved table)
    has are copied, those past its end are zero."""
    if not 0 <= start <= stop:
        raise ValueError(f"rows [{start}, {stop}) are not a range of table rows")
    out = saved.new_zeros((stop - start,) + tuple(saved.shape[1:]))
    kept = max(0, min(stop, saved.shape[0]) - start)
    if kept:
        out[:kept] = saved[start:start + kept]
    return out


def row_counts(vocab_size: int, saved_padded: int, padded: int) -> Dict[str, int]:
    """What a load at ``padded`` rows does to a table saved with ``saved_padded`` rows:
    ``real`` rows kept, saved ``dummy_kept`` rows, ``trimmed`` rows dropped, ``zero_filled``
    rows added."""
    if vocab_size > min(saved_padded, padded):
        raise ValueError(f"vocab_size {vocab_size} is larger than a padded size "
                         f"({saved_padded} saved, {padded} now): not a padding of it")
    return dict(real=vocab_size, dummy_kept=min(saved_padded, padded) - vocab_size,
                trimmed=max(0, saved_padded - padded), zero_filled=max(0, padded - saved_padded))


def describe(vocab_size: int, saved_padded: int, padded: int) -> str:
    """One line: the padding change and what the loader does with the rows."""
    c = row_counts(vocab_size, saved_padded, padded)
    if saved_padded == padded:
        return f"vocabulary padding unchanged ({padded} rows, {vocab_size} real)"
    what = (f"{c['trimmed']} dummy rows trimmed" if c["trimmed"]
            else f"{c['zero_filled']} zero rows added")
    return (f"vocabulary padding {saved_padded} -> {padded} rows ({vocab_size} real ids kept, "
            f"{c['dummy_kept']} saved dummy rows kept, {what}; Adam moments alike)")


def rows_of(param: Any, local_rows: int, tp_rank: int, split: bool) -> Tuple[int, int]:
    """The rows ``[start, stop)`` of the whole table that this rank's ``local_rows`` are."""
    if split and getattr(param, "partition_dim", 0) != 0:
        raise ValueError("a vocabulary table is split along its rows (partition_dim 0)")
    start = tp_rank * local_rows if split else 0
    return start, start + local_rows
