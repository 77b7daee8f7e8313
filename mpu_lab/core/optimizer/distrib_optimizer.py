"""Megatron's distributed optimizer (``--use-distributed-optimizer``; ZeRO stage 1 over the
data-parallel group): a hand-written teaching mirror of Megatron-core's
``core/optimizer/distrib_optimizer.py`` (``DistributedOptimizer``), simplified: fp32
parameters (mixed precision here is ``torch.autocast``, so the fp32 "main" parameters are the
parameters themselves, as in Megatron with fp32 params), AdamW only.

Each data-parallel rank owns one contiguous shard of every bucket of the gradient buffer
(:meth:`~mpu_lab.core.distributed.param_and_grad_buffer.Bucket.shard_range`). A step:

1. backward's gradients are **reduce-scattered** over the data-parallel group
   (:class:`~mpu_lab.core.distributed.distributed_data_parallel.DistributedDataParallel` with
   ``use_distributed_optimizer=True``): each rank receives the averaged gradient of its shard;
2. each rank runs AdamW on its shard only: its Adam moments exist for its shard only, so the
   optimizer states per rank are 1/d of the plain optimizer's;
3. the updated shards are **all-gathered** into every rank's parameter buffer.

With context parallelism the group is data x context parallel (Megatron's dp-cp group): the
context-parallel ranks hold the same weights, so they share the optimizer states like
data-parallel ranks (:func:`mpu_lab.training.setup.wrap_megatron_ddp` passes that group).

A reduce-scatter plus an all-gather move the same bytes as the one all-reduce of plain data
parallelism (an all-reduce *is* a reduce-scatter followed by an all-gather), so the memory is
saved for free in communication volume.

The shard of a parameter is a view into the parameter buffer (``shard_params``), its gradient a
view into the gradient buffer; a shard carries its parameter's tensor-parallel attributes, so
:func:`~mpu_lab.core.optimizer.clip_grad_norm` counts each gradient once when it sums the squares of
all shards over every rank (data x tensor x pipeline parallel).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from mpu_lab.core import comm
from mpu_lab.core.distributed.distributed_data_parallel import DistributedDataParallel

# what a shard tensor copies from its parameter (clipping and the loss scaler read them)
_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared",
               "sequence_parallel", "allreduce")


class DistributedOptimizer:
    """AdamW over this data-parallel rank's shards of ``ddp_modules``' buffers (each a
    :class:`DistributedDataParallel` built with ``use_distributed_optimizer=True``), Megatron's
    weight-decay groups (none on 1-D parameters). ``args``: ``lr``, ``weight_decay``,
    ``adam_beta1``, ``adam_beta2``, ``adam_eps``."""

    def __init__(self, ddp_modules: Sequence[DistributedDataParallel], args):
        for ddp in ddp_modules:
            if not ddp.use_distributed_optimizer:
                raise ValueError("DistributedOptimizer needs DistributedDataParallel("
                                 "use_distributed_optimizer=True): its gradients must be "
                                 "reduce-scattered into shards")
        self.ddp_modules = list(ddp_modules)
        # (model parameter, shard tensor, start, end): the shard is param.view(-1)[start:end]
        self.shards: List[Tuple[torch.nn.Parameter, torch.Tensor, int, int]] = []
        decay, no_decay = [], []
        for ddp in self.ddp_modules:
            buf, r = ddp.buffer, ddp.data_parallel_rank
            for bucket in buf.buckets:
                lo, hi = bucket.shard_range(r)
                lo, hi = bucket.offset + lo, bucket.offset + hi   # buffer coordinates
                for p in bucket.params:
                    _, start, end = buf.param_range(p)
                    a, b = max(start, lo), min(end, hi)
                    if a >= b:
                        continue           # this parameter lies outside this rank's shard
                    shard = buf.param_data[a:b]
                    shard.grad = buf.grad_data[a:b]
                    for name in _ATTRIBUTES:
                        if hasattr(p, name):
                            setattr(shard, name, getattr(p, name))
                    self.shards.append((p, shard, a - start, b - start))
                    (no_decay if p.dim() == 1 else decay).append(shard)
        groups = [dict(params=decay, weight_decay=args.weight_decay),
                  dict(params=no_decay, weight_decay=0.0)]
        self.optimizer = torch.optim.AdamW(groups, lr=args.lr,
                                           betas=(args.adam_beta1, args.adam_beta2),
                                           eps=args.adam_eps)

    # what the training loop and the learning-rate schedule use of a torch optimizer
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        """The inner AdamW's states, keyed by shard tensors: this rank's share only."""
        return self.optimizer.state

    @property
    def shard_params(self) -> List[torch.Tensor]:
        """This rank's shards (what clipping and the loss scaler work on)."""
        return [shard for _, shard, _, _ in self.shards]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every buffer's gradients in place (``set_to_none`` is accepted for torch's
        signature: the gradients live in the buffer, and each shard's ``.grad`` stays a view
        of it)."""
        for ddp in self.ddp_modules:
            ddp.zero_grad_buffer()

    def step(self) -> None:
        """AdamW on this rank's shards, then all-gather the updated shards over the
        data-parallel group into every rank's parameter buffer."""
        self.optimizer.step()
        self.gather_params()

    def gather_params(self) -> None:
        """All-gather each bucket's shards into the parameter buffer: every rank's full copy of
        the parameters is up to date again."""
        for ddp in self.ddp_modules:
            if ddp.data_parallel_size == 1:
                continue
            r = ddp.data_parallel_rank
            for bucket in ddp.buffer.buckets:
                lo, hi = bucket.shard_range(r)
                full = comm.all_gather(bucket.param_data[lo:hi], ddp.data_parallel_group)
                bucket.param_data.copy_(full)

    # ------------------------------------------------------------------ checkpoints
    def full_state(self) -> Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]:
        """Every parameter's whole Adam state (``exp_avg``, ``exp_avg_sq``, ``step``),
        assembled from every data-parallel rank's shards: what a checkpoint stores, the same
        layout as the plain optimizer's, so a checkpoint loads at any data-parallel size.
        Collective over the data-parallel group; zeros before the first step."""
        steps = [self.optimizer.state[shard]["step"] for _, shard, _, _ in self.shards
                 if self.optimizer.state.get(shard)]
        device = self.ddp_modules[0].buffer.param_data.device if self.ddp_modules else "cpu"
        step = torch.tensor(float(steps[0]) if steps else 0.0, dtype=torch.float32,
                            device=device)    # on the rank's device: NCCL takes no CPU tensor
        out: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]] = {}
        for ddp in self.ddp_modules:
            buf = ddp.buffer
            flat = {k: torch.zeros_like(buf.param_data) for k in ("exp_avg", "exp_avg_sq")}
            for p, shard, a, b in self.shards:
                if not _owned_by(ddp, p):
                    continue
                _, start, _ = buf.param_range(p)
                st = self.optimizer.state[shard]
                if not st:
                    continue       # no step taken yet: zeros
                for k in flat:
                    flat[k][start + a:start + b].copy_(st[k])
            for k in flat:   # each element is owned by one rank: the sum is the assembly
                flat[k] = comm.all_reduce(flat[k], ddp.data_parallel_group) \
                    if ddp.data_parallel_size > 1 else flat[k]
            for p in buf.params:
                _, start, end = buf.param_range(p)
                out[p] = {k: flat[k][start:end].view_as(p).clone() for k in flat}
        for ddp in self.ddp_modules[:1]:   # a rank that owns no shard knows no step count
            if ddp.data_parallel_size > 1:
                step = comm.all_reduce(step, ddp.data_parallel_group, op=dist.ReduceOp.MAX)
        for p in out:
            out[p]["step"] = step.cpu().reshape(())
        return out

    def load_full_state(self, states: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]) -> None:
        """Keep this rank's shards of whole per-parameter Adam states (from a checkpoint saved
        at any data-parallel size)."""
        for p, shard, a, b in self.shards:
            st = self.optimizer.state[shard]
            full = states[p]
            step = torch.as_tensor(full["step"], dtype=torch.float32)  # cpu: AdamW's step
            st["step"] = step.clone().reshape(())
            st["exp_avg"] = full["exp_avg"].reshape(-1)[a:b].to(shard.device).clone()
            st["exp_avg_sq"] = full["exp_avg_sq"].reshape(-1)[a:b].to(shard.device).clone()


def _owned_by(ddp: DistributedDataParallel, param: torch.nn.Parameter) -> bool:
    try:
        ddp.buffer.param_range(param)
        return True
    except KeyError:
        return False
