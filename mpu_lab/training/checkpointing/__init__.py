"""Distributed checkpoints with resharding, through ``torch.distributed.checkpoint`` (DCP) — the
lab's version of Megatron's ``megatron/training/checkpointing.py`` and
``megatron/core/dist_checkpointing``, in five modules: :mod:`~mpu_lab.training.checkpointing.files`
(finding and verifying folders, pure), :mod:`~mpu_lab.training.checkpointing.state_dict` (the sharded
state dict), :mod:`~mpu_lab.training.checkpointing.save_load` (save / load, collective),
:mod:`~mpu_lab.training.checkpointing.vocab_padding` (a change of vocabulary padding: dummy rows
trimmed or zero-filled) and :mod:`~mpu_lab.training.checkpointing.consolidate` (one ordinary state
dict; the command line).

Each tensor-parallel shard is saved as a ``DTensor`` over the tensor-parallel group
(``Shard(partition_dim)``): DCP records every shard with its *global* offsets, so a checkpoint
written at TP=2 can be read at TP=4 or TP=1 — each rank asks for the region it now owns and
DCP reads the overlapping pieces (the resharding of Megatron's ``dist_checkpointing``).
The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by x TP``, so the
embedding table's row count can change with TP: its real rows are kept and the dummy rows
trimmed or added as zeros (the real vocabulary itself must not change).

Pipeline stages save their layers under *global* layer numbers (``decoder.layers.<n>`` with
``n = layer_offset + i``, not the stage's local ``i``), so the keys are those of the one-stage
model whatever the pipeline size, and a checkpoint written at PP=2 loads at PP=1 or PP=4 the
same way. The last stage's copy of the tied embedding (``output_layer_weight``, marked
``shared``) is not saved: it is loaded from ``embedding.word_embeddings.weight``.
Replicated tensors (LayerNorms, position embedding, row-parallel biases) are plain tensors;
DCP writes one copy. Data-parallel replicas hold identical shards; DCP's planner writes each
once.

A checkpoint folder ``iter_0000100/`` holds DCP's data files and ``.metadata`` (written by
DCP only after every rank has written its data), then ``mpu_lab_checkpoint.json`` (written
by rank 0 after DCP returned: the "complete" marker, with the iteration, parallel sizes and
model shape, and the size and SHA-256 of every file DCP wrote). A folder without both is
incomplete — an interrupted save — and is never loaded; a file whose size or checksum differs
from the marker's is reported by name before anything is read (DCP itself keeps no
checksums: a flipped byte in a tensor would load silently). The parent folder gets Megatron's
``latest_checkpointed_iteration.txt``.

A rank killed mid-save (the reliability tests) comes from outside, from the lab kit: a DCP
``FileSystemWriter`` subclass passed as ``save_checkpoint``'s ``storage_writer``
(:func:`mpu_lab.training.faults.kill_in_save`, ``MPU_LAB_FAULT_IN_SAVE=RANK:ITERATION``).

What is saved: ``model.<name>`` (parameters), ``optimizer.<name>.{exp_avg,exp_avg_sq,step}``
(AdamW state, sharded like the parameter), ``scheduler``, with ``--fp16`` ``grad_scaler`` (the
loss scale, growth count and unspent hysteresis; not loaded with ``--no-load-optim``, as
Megatron keeps it in the optimizer's state), ``iteration``, ``args``, and the RNG
states per pipeline and tensor-parallel rank (``rng.pp<k>.tp<r>.*``: the default generator and
the tracker's tensor-parallel stream; all restored when the TP and PP sizes are unchanged;
otherwise only the default generator of stage 0 / TP rank 0, and the streams are reseeded as
at start).

Command line::

    python -m mpu_lab.training.checkpointing info CHECKPOINT
    python -m mpu_lab.training.checkpointing consolidate CHECKPOINT model.pt    # one ordinary state_dict
"""
from mpu_lab.training.checkpointing.consolidate import consolidate, gather_model_state_dict, main
from mpu_lab.training.checkpointing.files import (
    MARKER, MODEL_FIELDS, TRACKER, CheckpointError, check_compatible, file_records,
    find_checkpoint, incomplete_reason, iteration_dir, model_fields, read_checkpoint_info,
    verify_checkpoint)
from mpu_lab.training.checkpointing import vocab_padding
from mpu_lab.training.checkpointing.save_load import load_checkpoint, save_checkpoint
from mpu_lab.training.checkpointing.state_dict import TIED_EMBEDDING, checkpoint_names

__all__ = [
    "MARKER", "TRACKER", "MODEL_FIELDS", "TIED_EMBEDDING", "CheckpointError", "iteration_dir",
    "incomplete_reason", "find_checkpoint", "file_records", "verify_checkpoint",
    "read_checkpoint_info", "model_fields", "check_compatible", "checkpoint_names",
    "save_checkpoint", "load_checkpoint", "gather_model_state_dict", "consolidate", "main",
    "vocab_padding",
]
