"""Dynamic loss scaling for ``--fp16``, with the overflow check agreed on by the whole
model-parallel group (Megatron-core's ``core/optimizer/grad_scaler.py``,
``DynamicGradScaler``, plus the unscale-and-check of ``MixedPrecisionOptimizer``)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from mpu_lab.core import comm


class DynamicLossScaler:
    """fp16 loss scaling (Megatron's ``DynamicGradScaler``): halve the scale and skip the step
    on an overflow seen by *any* rank of the model-parallel group; double it after
    ``growth_interval`` clean steps."""

    def __init__(self, initial_scale: float = 2.0 ** 16, min_scale: float = 1.0,
                 growth_interval: int = 1000):
        self.scale, self.min_scale, self.growth_interval = initial_scale, min_scale, growth_interval
        self.clean_steps = 0

    def unscale_and_check(self, params, group) -> bool:
        grads = [p.grad for p in params if p.grad is not None]
        found = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
        for g in grads:
            g.mul_(1.0 / self.scale)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        if group is not None and comm.group_size(group) > 1:
            found = comm.all_reduce(found, group=group, op=dist.ReduceOp.MAX)
        return bool(found.item() > 0)

    def update(self, found_inf: bool):
        if found_inf:
            self.scale = max(self.min_scale, self.scale / 2)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= 2
