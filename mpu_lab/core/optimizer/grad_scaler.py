"""Dynamic loss scaling for ``--fp16`` (Megatron-core's ``core/optimizer/grad_scaler.py``,
``DynamicGradScaler``), plus the unscale-and-check of Megatron's ``MixedPrecisionOptimizer``
with the overflow agreed on by the whole model-parallel group. The scale is a Python float here
(Megatron keeps a one-element tensor on the GPU)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from mpu_lab.core import comm


class DynamicGradScaler:
    """fp16 loss scaling as Megatron's ``DynamicGradScaler``: a step whose gradients hold an
    inf or a NaN on *any* rank of the model-parallel group is skipped; the scale is multiplied
    by ``backoff_factor`` at the ``hysteresis``-th such step since the scale last grew (and at
    every one after it), never below ``min_scale``; after ``growth_interval`` clean steps in a
    row it is multiplied by ``growth_factor`` and the hysteresis count starts again.
    Megatron-LM builds it with ``--initial-loss-scale``, ``--min-loss-scale``,
    ``--loss-scale-window`` (the growth interval), ``--hysteresis``, growth 2 and backoff 0.5."""

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float,
                 backoff_factor: float, growth_interval: int, hysteresis: int):
        assert initial_scale > 0.0
        assert min_scale > 0.0 and min_scale <= initial_scale
        assert growth_factor > 1.0
        assert 0.0 < backoff_factor < 1.0
        assert growth_interval > 0
        assert hysteresis > 0
        self._scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0                  # clean steps since the last overflow
        self._hysteresis_tracker = self.hysteresis  # overflows still allowed before a backoff

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def inv_scale(self) -> float:
        return 1.0 / self._scale

    def update(self, found_inf: bool):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self):
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict):
        self._scale = float(state_dict["scale"])
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]

    def unscale_and_check(self, params, group) -> bool:
        """Megatron's ``_unscale_main_grads_and_check_for_nan``: multiply every gradient by
        ``inv_scale`` and return whether any rank of ``group`` found an inf or a NaN (a MAX
        all-reduce of the flag, so that every rank skips the same steps)."""
        grads = [p.grad for p in params if p.grad is not None]
        found = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
        for g in grads:
            g.mul_(self.inv_scale)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        if group is not None and comm.group_size(group) > 1:
            found = comm.all_reduce(found, group=group, op=dist.ReduceOp.MAX)
        return bool(found.item() > 0)
