"""The recording hook of the shape table: the model blocks note their tensors' shapes here.

:class:`~mpu_lab.models.attention.SelfAttention` and :class:`~mpu_lab.models.mlp.MLP` call
:func:`record` at each step of their forward (Q, K, V, Score, Z, Out, A, A', x'); it costs
nothing unless a :func:`record_activations` block is open. It imports nothing from
:mod:`mpu_lab.models`, so the blocks and :mod:`mpu_lab.models.introspection` (which builds a
layer and reads the record) do not import each other. Megatron has no counterpart: this is
the lab's instrument for the lecture's shape table.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Sequence, Tuple

import torch

_RECORDING: List[Dict[str, Tuple[tuple, tuple]]] = []


def record(name: str, tensor: torch.Tensor, dims: Sequence[str] = ()) -> None:
    """Remember ``tensor``'s shape (and the meaning of each dimension) under ``name`` if a
    :func:`record_activations` block is open. The first layer to record a name wins."""
    if _RECORDING and name not in _RECORDING[-1]:
        _RECORDING[-1][name] = (tuple(tensor.shape), tuple(dims))


@contextlib.contextmanager
def record_activations():
    """``with record_activations() as shapes:`` -> ``{name: (shape, dims)}`` of the forward."""
    shapes: Dict[str, Tuple[tuple, tuple]] = {}
    _RECORDING.append(shapes)
    try:
        yield shapes
    finally:
        _RECORDING.remove(shapes)
