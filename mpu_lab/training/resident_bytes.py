"""What a rank holds for training, counted from its tensors (the ``--metrics-file`` fields
``param_bytes``, ``grad_bytes``, ``optimizer_state_bytes``): :func:`resident_bytes`, called by
the train step right after ``optimizer.step()``, before the next step zeroes the gradients.

Counted, not predicted: the bytes of every distinct storage behind

* the parameters: each model parameter's ``.data`` (empty under ZeRO-3 outside forward and
  backward), the tensors the optimizer steps (the distributed optimizer's shards are views of
  the parameter buffer, counted once), Megatron-DDP's parameter buffer and Megatron-FSDP's
  per-unit buffers (``main_weight``, ``model_weight``);
* the gradients: each ``.grad``, Megatron-DDP's gradient buffer (whole, padding included: it
  persists from step to step) and Megatron-FSDP's gradient shards (``main_grad``);
* the optimizer's states: every tensor in ``optimizer.state`` (AdamW's ``exp_avg``,
  ``exp_avg_sq`` and its 4-byte ``step`` per stepped tensor).

A storage is counted whole, once, however many views point into it (its padding too): what a
memory profiler would see held. The cost model's predictions
(:mod:`mpu_lab.perf.cost_model.fsdp`) are checked against these counts, not the other way round.
"""
from __future__ import annotations

from typing import Dict, Iterable, Iterator

import torch

RESIDENT_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes")


def storage_bytes(tensors: Iterable) -> int:
    """The bytes of the distinct storages behind ``tensors`` (None and non-tensors skipped)."""
    seen: Dict[tuple, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            storage = t.untyped_storage()
            seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def _wrapper_tensors(chunks, kind: str) -> Iterator[torch.Tensor]:
    """The persistent buffers of Megatron-DDP (``buffer``) and Megatron-FSDP
    (``parameter_groups``) wrappers, of parameters (``kind="param"``) or gradients."""
    for chunk in chunks:
        buffer = getattr(chunk, "buffer", None)
        if buffer is not None:
            yield buffer.param_data if kind == "param" else buffer.grad_data
        for group in getattr(chunk, "parameter_groups", ()):
            if kind == "param":
                yield group.main_weight
                yield group.model_weight
            else:
                yield group.main_grad


def _optimized_tensors(optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def resident_bytes(state) -> Dict[str, int]:
    """``{"param_bytes", "grad_bytes", "optimizer_state_bytes"}`` of this rank, counted from
    ``state`` (a :class:`~mpu_lab.training.setup.TrainState`)."""
    params = [p for chunk in state.model_chunks for p in chunk.parameters()]
    chunks = getattr(state, "ddp_chunks", ())
    optimized = list(_optimized_tensors(state.optimizer))
    param_bytes = storage_bytes([p.data for p in params] + optimized
                                + list(_wrapper_tensors(chunks, "param")))
    grad_bytes = storage_bytes([p.grad for p in params] + [t.grad for t in optimized]
                               + list(_wrapper_tensors(chunks, "grad")))
    optimizer_state_bytes = storage_bytes(
        t for st in state.optimizer.state.values() for t in st.values())
    return dict(param_bytes=param_bytes, grad_bytes=grad_bytes,
                optimizer_state_bytes=optimizer_state_bytes)
