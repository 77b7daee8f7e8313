"""One flat buffer for a model's parameters and one for their gradients, cut into buckets: a
hand-written teaching mirror of Megatron-core's ``core/distributed/param_and_grad_buffer.py``
(``_ParamAndGradBuffer``, ``_ParamAndGradBucket``), simplified: fp32 only, one buffer per
model chunk, no bucket groups, no expert parallelism.

Why flat buffers: a data-parallel step reduces every gradient over the data-parallel group. One
collective per parameter would pay its latency hundreds of times; one collective for the whole
model could only start once backward has finished. A bucket is the middle way: a contiguous
slice of the gradient buffer that holds a few parameters' gradients and is reduced with one
collective as soon as all of them are ready (``overlap_grad_reduce``).

The layout, as Megatron's:

* parameters go into the buffer in **reverse** order of ``module.parameters()``: backward
  produces the last layer's gradients first, so the first bucket is ready first;
* a new bucket starts once the current one holds ``bucket_size`` elements or more (Megatron's
  ``--ddp-bucket-size``; ``None``: one bucket);
* each bucket is padded to a multiple of the data-parallel size ``d``, so that the distributed
  optimizer can give each data-parallel rank an equal, contiguous shard of it
  (:meth:`Bucket.shard_range`);
* every parameter's ``.data`` becomes a view into ``param_data`` and its ``.main_grad`` a view
  into ``grad_data``: the model computes and autograd accumulates straight into the buffers.

``late_params`` go into buckets of their own at the end: their gradients need a model-parallel
reduction (the sequence-parallel LayerNorm sums over the tensor-parallel group, the tied
embedding over the first and last pipeline stage) before the data-parallel one, so their
buckets are never reduced during backward (see
:class:`~mpu_lab.core.distributed.distributed_data_parallel.DistributedDataParallel`).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch


def _padded(numel: int, multiple: int) -> int:
    return -(-numel // multiple) * multiple


@dataclasses.dataclass
class Bucket:
    """A contiguous slice of the buffers holding some parameters; reduced as one."""
    index: int
    params: List[torch.nn.Parameter]
    offset: int                  # where the bucket starts in the buffers
    numel: int                   # padded to a multiple of the data-parallel size
    numel_unpadded: int
    data_parallel_size: int
    late: bool = False
    param_data: Optional[torch.Tensor] = None   # views into the buffers, set by the buffer
    grad_data: Optional[torch.Tensor] = None

    def shard_range(self, data_parallel_rank: int) -> Tuple[int, int]:
        """The bucket-local slice ``[start, end)`` that a data-parallel rank owns under the
        distributed optimizer: the ``d`` shards are equal and contiguous, rank order."""
        if not 0 <= data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is not in "
                             f"[0, {self.data_parallel_size})")
        size = self.numel // self.data_parallel_size
        return data_parallel_rank * size, (data_parallel_rank + 1) * size


class ParamAndGradBuffer:
    """The flat parameter and gradient buffers of ``params`` (see the module docstring).

    ``data_parallel_size``: the size of the group the buckets are reduced over (their padding);
    ``bucket_size``: elements per bucket before a new one starts (``None``: one bucket, plus
    one for ``late_params`` if any). The parameters must be fp32 and on one device.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], data_parallel_size: int,
                 bucket_size: Optional[int] = None,
                 late_params: Iterable[torch.nn.Parameter] = ()):
        params = [p for p in params if p.requires_grad]
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        if bucket_size is not None and bucket_size < 1:
            raise ValueError(f"bucket_size must be a positive number of elements or None, "
                             f"got {bucket_size}")
        if not params:
            raise ValueError("no parameter that requires a gradient: nothing to put in a buffer")
        dtypes = sorted({str(p.dtype) for p in params})
        devices = sorted({str(p.device) for p in params})
        if dtypes != ["torch.float32"] or len(devices) != 1:
            raise ValueError(f"the buffer holds fp32 parameters on one device; got dtypes "
                             f"{dtypes} on devices {devices}")
        late_ids = {id(p) for p in late_params}
        self.data_parallel_size = data_parallel_size
        self.params: List[torch.nn.Parameter] = []
        self.buckets: List[Bucket] = []
        self._ranges: Dict[int, Tuple[int, int, int]] = {}

        ordered = [p for p in reversed(params) if id(p) not in late_ids]
        late = [p for p in reversed(params) if id(p) in late_ids]
        offset = 0
        for group, is_late in ((ordered, False), (late, True)):
            current: List[torch.nn.Parameter] = []
            for p in group:
                current.append(p)
                if bucket_size is not None and sum(q.numel() for q in current) >= bucket_size:
                    offset = self._close_bucket(current, offset, is_late)
                    current = []
            if current:
                offset = self._close_bucket(current, offset, is_late)
        self.numel = offset
        self.numel_unpadded = sum(p.numel() for p in self.params)

        device = params[0].device
        self.param_data = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.grad_data = torch.zeros(self.numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p in self.params:
                _, start, end = self._ranges[id(p)]
                self.param_data[start:end].copy_(p.data.reshape(-1))
                p.data = self.param_data[start:end].view_as(p)
                p.main_grad = self.grad_data[start:end].view_as(p)
        for b in self.buckets:
            b.param_data = self.param_data[b.offset:b.offset + b.numel]
            b.grad_data = self.grad_data[b.offset:b.offset + b.numel]

    def _close_bucket(self, params: List[torch.nn.Parameter], offset: int, late: bool) -> int:
        start = offset
        for p in params:
            self._ranges[id(p)] = (len(self.buckets), offset, offset + p.numel())
            self.params.append(p)
            offset += p.numel()
        unpadded = offset - start
        numel = _padded(unpadded, self.data_parallel_size)
        self.buckets.append(Bucket(len(self.buckets), list(params), start, numel, unpadded,
                                   self.data_parallel_size, late))
        return start + numel

    def param_range(self, param: torch.nn.Parameter) -> Tuple[int, int, int]:
        """``(bucket index, start, end)`` of ``param`` in buffer coordinates."""
        try:
            return self._ranges[id(param)]
        except KeyError:
            raise KeyError("this parameter is not in the buffer") from None

    def table(self) -> List[Dict[str, object]]:
        """One row per bucket: its index, parameters (count), elements (unpadded and padded),
        whether it is late, and its offset; what lab 04 prints."""
        return [dict(bucket=b.index, params=len(b.params), numel=b.numel_unpadded,
                     padded=b.numel, late=b.late, offset=b.offset) for b in self.buckets]
