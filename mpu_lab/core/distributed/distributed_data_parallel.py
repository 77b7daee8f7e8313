"""Data parallelism as Megatron does it: a hand-written teaching mirror of Megatron-core's
``core/distributed/distributed_data_parallel.py`` (``DistributedDataParallel``), simplified:
fp32 gradients, one buffer per model chunk, readiness counted per micro-batch instead of
Megatron's ``no_sync`` context and pipeline-schedule hooks.

torch's own ``DistributedDataParallel`` (what ``train_gpt.py`` uses by default) buckets and
overlaps as well; this mirror exists so a learner can read the mechanism in 200 lines, and
because Megatron's distributed optimizer needs what torch DDP does not give: a reduce-scatter
into contiguous per-rank shards of one flat gradient buffer.

How a step goes:

1. :meth:`DistributedDataParallel.zero_grad_buffer` zeroes the gradient buffer and points every
   parameter's ``.grad`` at its slice of it (``main_grad``): autograd then accumulates each
   micro-batch's gradient in place, in the buffer.
2. During backward, a hook on each parameter counts its gradients. Once a parameter has had
   one per micro-batch, it is ready; once every parameter of a bucket is ready and
   ``overlap_grad_reduce`` is on, that bucket's reduction starts at once, asynchronously, while
   backward goes on with the earlier layers (Megatron's ``--overlap-grad-reduce``).
3. :meth:`DistributedDataParallel.finish_grad_sync` starts the buckets not started yet and
   waits for all of them. The reduction is an average over the data-parallel group: an
   all-reduce (every rank gets the whole averaged gradient) or, for the distributed optimizer,
   a reduce-scatter (each rank gets the average of its own shard of each bucket only). With
   context parallelism the trainer passes the data x context parallel group (Megatron's
   dp-cp): its ranks hold the same weights and different tokens.

Buckets of ``late_params`` (see :mod:`~mpu_lab.core.distributed.param_and_grad_buffer`) are reduced
only by ``finish_grad_sync(late=True)``, which the caller runs after the model-parallel sums of
those gradients.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch
import torch.distributed as dist

from mpu_lab.core import comm
from mpu_lab.core.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` for data parallelism over ``data_parallel_group`` (default: the world).

    ``overlap_grad_reduce``: start each bucket's reduction during backward, as soon as it is
    ready. ``use_distributed_optimizer``: reduce-scatter instead of all-reduce (each rank keeps
    the averaged gradient of its shard only). ``bucket_size``: elements per bucket (``None``:
    one bucket). ``num_micro_batches``: backward passes per step (gradient accumulation; a
    parameter is ready after that many). ``late_params``: see the module docstring.

    Mixture of experts (Megatron keeps the expert parameters in a buffer of their own):
    ``params`` picks which of ``module``'s parameters this instance reduces (default: all), and
    ``gradient_scaling_factor`` what the reduced sum is multiplied by (default ``1 / group
    size``, the average). The trainer wraps a chunk twice: the dense parameters over the
    data-parallel group, the expert ones over the expert-data-parallel group, both scaled by
    ``1 / d``, ``d`` the dense data-parallel size.
    """

    def __init__(self, module: torch.nn.Module, data_parallel_group=None, *,
                 overlap_grad_reduce: bool = False, use_distributed_optimizer: bool = False,
                 bucket_size: Optional[int] = None, num_micro_batches: int = 1,
                 late_params: Iterable[torch.nn.Parameter] = (),
                 params: Optional[Iterable[torch.nn.Parameter]] = None,
                 gradient_scaling_factor: Optional[float] = None):
        super().__init__()
        if num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
        self.module = module
        self.data_parallel_group = data_parallel_group
        self.data_parallel_size = comm.group_size(data_parallel_group)
        self.data_parallel_rank = dist.get_rank(group=data_parallel_group) \
            if data_parallel_group is not None else dist.get_rank()
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.num_micro_batches = num_micro_batches
        self.gradient_scaling_factor = gradient_scaling_factor
        params = list(module.parameters()) if params is None else list(params)
        self.buffer = ParamAndGradBuffer(params, self.data_parallel_size,
                                         bucket_size, late_params)
        self._counts: Dict[int, int] = {}
        self._pending: Dict[int, comm.Pending] = {}
        self._bucket_of = {id(p): self.buffer.param_range(p)[0] for p in self.buffer.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook())
                       for p in self.buffer.params]
        self.zero_grad_buffer()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ a step
    def zero_grad_buffer(self) -> None:
        """Before a step: zero the gradient buffer, point each ``.grad`` at its ``main_grad``
        slice, forget the last step's readiness and reductions."""
        self.buffer.grad_data.zero_()
        for p in self.buffer.params:
            p.grad = p.main_grad
        self._counts = {id(p): 0 for p in self.buffer.params}
        self._pending = {}

    def _make_hook(self):
        def hook(param: torch.nn.Parameter) -> None:
            key = id(param)
            b = self.buffer.buckets[self._bucket_of[key]]
            if b.index in self._pending:
                raise RuntimeError(
                    f"a gradient arrived for bucket {b.index} after its reduction started: "
                    f"more backward passes than num_micro_batches={self.num_micro_batches} "
                    f"in this step (call zero_grad_buffer() before each step)")
            self._counts[key] += 1
            if self.overlap_grad_reduce and not b.late and self._ready(b):
                self._start(b)
        return hook

    def _ready(self, bucket: Bucket) -> bool:
        return all(self._counts[id(p)] >= self.num_micro_batches for p in bucket.params)

    def _start(self, bucket: Bucket) -> None:
        """Start the bucket's reduction (asynchronously)."""
        if self.use_distributed_optimizer:
            pending = comm.reduce_scatter_async(bucket.grad_data, self.data_parallel_group)
        else:
            pending = comm.all_reduce_async(bucket.grad_data, self.data_parallel_group)
        self._pending[bucket.index] = pending

    def _finish(self, bucket: Bucket) -> None:
        result = self._pending[bucket.index].wait()
        d = self.data_parallel_size
        if self.use_distributed_optimizer:
            start, end = bucket.shard_range(self.data_parallel_rank)
            self._scale(bucket.grad_data[start:end].copy_(result), d)
        else:
            self._scale(bucket.grad_data.copy_(result), d)

    def _scale(self, grads: torch.Tensor, d: int) -> None:
        if self.gradient_scaling_factor is None:
            grads.div_(d)       # the average over the group
        else:
            grads.mul_(self.gradient_scaling_factor)

    def finish_grad_sync(self, late: bool = False) -> None:
        """Start the reductions of the buckets (``late``: the late ones) not started yet, then
        wait for all of them and write the averages into the gradient buffer. With one
        data-parallel rank there is nothing to reduce (only a ``gradient_scaling_factor`` to
        apply)."""
        buckets = [b for b in self.buffer.buckets if b.late == late]
        if self.data_parallel_size == 1:
            if self.gradient_scaling_factor not in (None, 1.0):
                for b in buckets:
                    self._scale(b.grad_data, 1)
            return
        for b in buckets:
            if b.index not in self._pending:
                self._start(b)
        for b in buckets:
            self._finish(b)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)
