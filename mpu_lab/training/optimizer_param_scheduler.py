"""The learning-rate schedule, counted in iterations: linear warmup, then constant, linear or
cosine decay to the minimum (Megatron's ``megatron/training/optimizer_param_scheduler.py``,
``OptimizerParamScheduler``, learning rate only), and :func:`build_scheduler` from the flags."""
from __future__ import annotations

import math
from typing import Any, Dict


class OptimizerParamScheduler:
    """Megatron's learning-rate schedule, counted in iterations: linear warmup from 0 to
    ``max_lr`` over ``warmup_steps``, then ``constant`` / ``linear`` / ``cosine`` decay to
    ``min_lr`` at ``decay_steps``, ``min_lr`` after. Step ``k`` (1-based) uses
    ``get_lr(k - 1)``, as Megatron (which starts counting at 0)."""

    def __init__(self, optimizer, max_lr: float, min_lr: float, warmup_steps: int,
                 decay_steps: int, decay_style: str):
        if decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"decay_style must be constant, linear or cosine, got {decay_style!r}")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style = decay_style
        self.num_steps = 0
        self._apply(self.get_lr(0))

    def get_lr(self, num_steps: int) -> float:
        if self.warmup_steps > 0 and num_steps <= self.warmup_steps:
            return self.max_lr * num_steps / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if num_steps > self.decay_steps:
            return self.min_lr
        ratio = (num_steps - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _apply(self, lr: float):
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def lr_for_next_step(self) -> float:
        lr = self.get_lr(self.num_steps)
        self._apply(lr)
        return lr

    def step(self):
        self.num_steps += 1

    def state_dict(self) -> Dict[str, Any]:
        return dict(num_steps=self.num_steps, max_lr=self.max_lr, min_lr=self.min_lr,
                    warmup_steps=self.warmup_steps, decay_steps=self.decay_steps,
                    decay_style=self.decay_style)

    def load_state_dict(self, state: Dict[str, Any]):
        # The step count comes from the checkpoint; the schedule's shape from this run's flags.
        self.num_steps = int(state["num_steps"])


def build_scheduler(optimizer, args) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(optimizer, args.lr, args.min_lr, args.lr_warmup_steps,
                                   args.lr_decay_iters,
                                   "constant" if args.lr_decay_style == "constant" else args.lr_decay_style)
