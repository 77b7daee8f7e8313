"""One FSDP unit's flat buffers and the all-gathers of its shard: a hand-written teaching
mirror of Megatron-FSDP's ``param_and_grad_buffer.py``
(``megatron/core/distributed/fsdp/src/megatron_fsdp/``: ``ParameterGroup``,
``DataParallelBuffer``, ``AllGatherPipeline``), simplified: fp32 only, one flat buffer per
unit (Megatron may cut a unit into several buckets by dtype), no HSDP.

A :class:`ParameterGroup` is one FSDP unit (a transformer layer; or the root: the parameters of
the model that belong to no unit). Its parameters lie end to end in one flat buffer of
``numel`` elements, padded to a multiple of the data-parallel size ``d`` so that each
data-parallel rank owns an equal, contiguous ``numel / d`` shard of it — Megatron's
``_pad`` of the ``DataParallelBuffer``:

* ``main_weight``: this rank's shard of the parameters (what the optimizer updates);
* ``main_grad``: this rank's shard of the averaged gradients (what the reduce-scatter of the
  unit's gradients writes into; zeroed before each step);
* ``model_weight``: the whole flat buffer of parameters (each parameter's ``.data`` a view of
  it) — kept for good under ``optim_grads`` (``main_weight`` is then a view of it), made by an
  all-gather of the shards before the unit runs and dropped after under
  ``optim_grads_params`` (ZeRO-3: each parameter's ``.data`` is then an empty tensor).

:class:`AllGatherPipeline` issues the all-gathers asynchronously (through
:mod:`mpu_lab.core.comm`), so the next unit's parameters travel while this one computes
(Megatron's prefetch), and waits for a unit's just before it runs.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from mpu_lab.core import comm


def _pad(number_to_be_padded: int, divisor: int) -> int:
    """``number_to_be_padded`` rounded up to a multiple of ``divisor`` (Megatron's ``_pad``)."""
    return -(-number_to_be_padded // divisor) * divisor


class ParameterGroup:
    """The flat buffers of one FSDP unit (see the module docstring). ``params``: the unit's
    parameters (those that require a gradient), fp32, on one device; ``fsdp_unit_id``: its
    place in forward order (0 is the root); ``shard_params``: keep only this rank's shard of
    the parameters (``optim_grads_params``) or the whole flat buffer (``optim_grads``)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], fsdp_unit_id: int,
                 data_parallel_size: int, data_parallel_rank: int, shard_params: bool):
        self.params = [p for p in params if p.requires_grad]
        dtypes = sorted({str(p.dtype) for p in self.params})
        if self.params and dtypes != ["torch.float32"]:
            raise ValueError(f"FSDP unit {fsdp_unit_id}: the flat buffers hold fp32 "
                             f"parameters; got dtypes {dtypes}")
        self.fsdp_unit_id = fsdp_unit_id
        self.data_parallel_size, self.data_parallel_rank = data_parallel_size, data_parallel_rank
        self.shard_params = shard_params
        self.shapes: Dict[int, torch.Size] = {id(p): p.shape for p in self.params}
        self._ranges: Dict[int, Tuple[int, int]] = {}
        offset = 0
        for p in self.params:
            self._ranges[id(p)] = (offset, offset + p.numel())
            offset += p.numel()
        self.numel_unpadded = offset
        self.numel = _pad(max(offset, 1), data_parallel_size)
        self.shard_numel = self.numel // data_parallel_size
        self.shard_start = data_parallel_rank * self.shard_numel
        device = self.params[0].device if self.params else torch.device("cpu")
        full = torch.zeros(self.numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p in self.params:
                start, end = self._ranges[id(p)]
                full[start:end].copy_(p.data.reshape(-1))
        if shard_params:
            self.model_weight: Optional[torch.Tensor] = None
            self.main_weight = self.local_shard(full).clone()   # only the shard stays
            self.release()
        else:
            self.model_weight = full
            self.main_weight = self.local_shard(full)             # a view: stepped in place
            self.install(full)
        self.main_grad = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)

    # ------------------------------------------------------------------ layout
    def local_shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's ``[shard_start, shard_start + shard_numel)`` of a flat unit buffer."""
        return flat[self.shard_start:self.shard_start + self.shard_numel]

    def param_range(self, param: torch.nn.Parameter) -> Tuple[int, int]:
        """``[start, end)`` of ``param`` in the unit's flat buffer."""
        return self._ranges[id(param)]

    def shard_range(self, param: torch.nn.Parameter) -> Optional[Tuple[int, int]]:
        """The part of ``param`` this rank owns, ``(a, b)`` in ``param.view(-1)`` coordinates,
        or None when it lies wholly in other ranks' shards."""
        start, end = self._ranges[id(param)]
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        a, b = max(start, lo), min(end, hi)
        return (a - start, b - start) if a < b else None

    # ------------------------------------------------------------------ parameters
    def install(self, full: torch.Tensor) -> None:
        """Point every parameter's ``.data`` at its slice of ``full`` (the whole flat
        buffer): the unit is unsharded. Setting ``.data`` leaves autograd's version counter
        alone, so a parameter saved for backward is read again with the data installed then."""
        for p in self.params:
            start, end = self._ranges[id(p)]
            p.data = full[start:end].view(self.shapes[id(p)])

    def release(self) -> None:
        """Free the unsharded parameters: each ``.data`` becomes an empty tensor (ZeRO-3
        between uses; Megatron's ``release_module_parameters``)."""
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    @property
    def is_unsharded(self) -> bool:
        return all(p.numel() == p.data.numel() and p.shape == self.shapes[id(p)]
                   for p in self.params) and bool(self.params)

    # ------------------------------------------------------------------ gradients
    def flat_grad(self) -> torch.Tensor:
        """The unit's gradients of this backward end to end, zero-padded to ``numel`` (a
        parameter without a gradient counts as zeros, as in Megatron's always-present
        buffer); the ``.grad`` are dropped: the reduce-scatter's result is what stays."""
        flat = torch.zeros(self.numel, dtype=torch.float32, device=self.main_grad.device)
        for p in self.params:
            if p.grad is not None:
                start, end = self._ranges[id(p)]
                flat[start:end].copy_(p.grad.reshape(-1))
                p.grad = None
        return flat


class AllGatherPipeline:
    """The all-gathers of the units' parameter shards over ``data_parallel_group``
    (``optim_grads_params``): :meth:`async_bucket_gather` starts one (a prefetch: it runs
    while the caller computes), :meth:`wait_bucket_ready` waits for it (starting it first if
    nobody did) and installs the whole parameters, :meth:`release_bucket` frees them."""

    def __init__(self, groups: List[ParameterGroup], data_parallel_group):
        self.groups = groups
        self.data_parallel_group = data_parallel_group
        self.pending: Dict[int, comm.Pending] = {}

    def async_bucket_gather(self, group: ParameterGroup) -> None:
        if group.is_unsharded or group.fsdp_unit_id in self.pending or not group.params:
            return
        self.pending[group.fsdp_unit_id] = comm.all_gather_async(group.main_weight,
                                                                 self.data_parallel_group)

    def wait_bucket_ready(self, group: ParameterGroup) -> None:
        if group.is_unsharded or not group.params:
            return
        self.async_bucket_gather(group)
        group.install(self.pending.pop(group.fsdp_unit_id).wait())

    def release_bucket(self, group: ParameterGroup) -> None:
        if group.fsdp_unit_id in self.pending:      # a prefetch nobody used: let it land
            self.pending.pop(group.fsdp_unit_id).wait()
        group.release()

    def gather_all(self) -> None:
        """Every unit unsharded (checkpoints: the whole parameters, collective)."""
        for group in self.groups:
            self.wait_bucket_ready(group)

    def release_all(self) -> None:
        for group in self.groups:
            self.release_bucket(group)
