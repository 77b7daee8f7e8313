"""The optimizer over Megatron-FSDP's shards (``optim_grads``, ``optim_grads_params``): the
part of Megatron-FSDP's ``fully_shard.py`` (``fully_shard_optimizer``) this lab uses, written
as a wrapper instead of Megatron's patched ``optimizer.step``: AdamW with Megatron's
weight-decay groups over the pieces of parameters this data-parallel rank owns
(:meth:`~mpu_lab.core.distributed.fsdp.megatron_fsdp.MegatronFSDP.optimizer_shards`, Megatron's
distributed parameters), then ``install_optimized_model_weights`` after each step.

It keeps the distributed optimizer's interface
(:class:`~mpu_lab.core.optimizer.DistributedOptimizer`): ``shard_params`` (clipping and the
loss scaler work on them, their squares summed over every rank), ``full_state`` /
``load_full_state`` (a checkpoint stores each parameter's whole Adam state, so it loads under
any strategy and data-parallel size).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from mpu_lab.core import comm
from mpu_lab.core.distributed.fsdp.megatron_fsdp import MegatronFSDP

# what a shard tensor copies from its parameter (clipping and the loss scaler read them)
_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared",
               "sequence_parallel", "allreduce")


class FullyShardedOptimizer:
    """AdamW over this rank's shards of ``fsdp_modules`` (:class:`MegatronFSDP`); no weight
    decay on the shards of 1-D parameters. ``args``: ``lr``, ``weight_decay``,
    ``adam_beta1``, ``adam_beta2``, ``adam_eps``."""

    def __init__(self, fsdp_modules: Sequence[MegatronFSDP], args):
        self.fsdp_modules = list(fsdp_modules)
        self.shards: List[Tuple[MegatronFSDP, torch.nn.Parameter, torch.Tensor, int, int]] = []
        decay, no_decay = [], []
        for fsdp in self.fsdp_modules:
            for p, shard, a, b in fsdp.optimizer_shards():
                for name in _ATTRIBUTES:
                    if hasattr(p, name):
                        setattr(shard, name, getattr(p, name))
                self.shards.append((fsdp, p, shard, a, b))
                shape = fsdp.parameter_group(p).shapes[id(p)]
                (no_decay if len(shape) == 1 else decay).append(shard)
        groups = [dict(params=decay, weight_decay=args.weight_decay),
                  dict(params=no_decay, weight_decay=0.0)]
        self.optimizer = torch.optim.AdamW(groups, lr=args.lr,
                                           betas=(args.adam_beta1, args.adam_beta2),
                                           eps=args.adam_eps)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        """The inner AdamW's states, keyed by shard tensors: this rank's share only."""
        return self.optimizer.state

    @property
    def shard_params(self) -> List[torch.Tensor]:
        return [shard for _, _, shard, _, _ in self.shards]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient shards (they live in the units' ``main_grad``)."""
        for fsdp in self.fsdp_modules:
            fsdp.zero_grad_buffer()

    def step(self) -> None:
        """AdamW on this rank's shards, then the whole parameters brought up to date
        (``optim_grads``: all-gathered; ``optim_grads_params``: nothing to do)."""
        self.optimizer.step()
        for fsdp in self.fsdp_modules:
            fsdp.install_optimized_model_weights()

    # ------------------------------------------------------------------ checkpoints
    def full_state(self) -> Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]:
        """Every parameter's whole Adam state (``exp_avg``, ``exp_avg_sq``, ``step``): each
        unit's state shards all-gathered over the data-parallel group. Collective; zeros
        before the first step."""
        steps = [float(st["step"]) for st in self.optimizer.state.values() if st]
        out: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]] = {}
        device = self.fsdp_modules[0].main_device if self.fsdp_modules else torch.device("cpu")
        step = torch.tensor(max(steps) if steps else 0.0, dtype=torch.float32, device=device)
        for fsdp in self.fsdp_modules:
            for group in fsdp.parameter_groups:
                flat = {k: torch.zeros_like(group.main_weight) for k in ("exp_avg", "exp_avg_sq")}
                for owner, p, shard, a, b in self.shards:
                    st = self.optimizer.state.get(shard)
                    if owner is not fsdp or fsdp.parameter_group(p) is not group or not st:
                        continue
                    lo = group.param_range(p)[0] + a - group.shard_start
                    for k in flat:
                        flat[k][lo:lo + b - a].copy_(st[k])
                if fsdp.data_parallel_size > 1:
                    flat = {k: comm.all_gather(v, fsdp.data_parallel_group)
                            for k, v in flat.items()}
                for p in group.params:
                    start, end = group.param_range(p)
                    out[p] = {k: v[start:end].view(group.shapes[id(p)]).clone()
                              for k, v in flat.items()}
            if fsdp.data_parallel_size > 1:   # a rank that owns no shard knows no step count
                step = comm.all_reduce(step, fsdp.data_parallel_group, op=dist.ReduceOp.MAX)
        for p in out:
            out[p]["step"] = step.cpu().reshape(()).clone()
        return out

    def load_full_state(self, states: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]) -> None:
        """Keep this rank's shards of whole per-parameter Adam states (from a checkpoint saved
        under any strategy and data-parallel size)."""
        for _, p, shard, a, b in self.shards:
            st = self.optimizer.state[shard]
            full = states[p]
            step = torch.as_tensor(full["step"], dtype=torch.float32)   # cpu: AdamW's step
            st["step"] = step.clone().reshape(())
            st["exp_avg"] = full["exp_avg"].reshape(-1)[a:b].to(shard.device).clone()
            st["exp_avg_sq"] = full["exp_avg_sq"].reshape(-1)[a:b].to(shard.device).clone()
