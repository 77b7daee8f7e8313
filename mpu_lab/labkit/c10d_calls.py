"""What a learner's function asked of ``torch.distributed``, seen from outside it: the graders'
view of the collectives and messages it ran.

Whichever way the learner calls them — ``dist.all_reduce``, ``dist.reduce_scatter_tensor``,
:mod:`mpu_lab.core.comm`'s functions, ``dist.isend``, ``comm.exchange.send_recv``,
``dist.batch_isend_irecv`` — every collective and every point-to-point message ends in one c10d
operation of torch's dispatcher (``c10d.allreduce_``, ``c10d._reduce_scatter_base_``,
``c10d.send``, ...), on gloo and NCCL alike. torch's ``CommDebugMode`` (here through
:class:`mpu_lab.perf.comm_counts.CollectiveLog`, the project's one way of counting collectives)
is a dispatch mode that sees each of them with its arguments: the tensors, the process group,
and ``async_op`` (whether the caller asked not to wait). Nothing in ``torch.distributed`` or
``mpu_lab`` is wrapped or replaced.

    with C10dCalls() as calls:
        got = learner(x, group)
    calls.collectives()      # ["reduce-scatter", "all-gather"]: what it did, in order
    calls.sent_bytes()       # bytes of the tensors it sent point-to-point

``on_call``: a function called with each :class:`C10dCall` as it is dispatched, before the
operation runs (its input still holds what the caller passed): a grader's way to note its own
state at that moment (how far backward got, which buffer the tensor is).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

import torch

from mpu_lab.perf.comm_counts import CollectiveLog

# c10d op -> (what the graders call it, index of this rank's input among the op's arguments)
OPS = {
    "c10d.allreduce_": ("all-reduce", 0),
    "c10d.allreduce_coalesced_": ("all-reduce", 0),
    "c10d.reduce_scatter_": ("reduce-scatter", 1),
    "c10d._reduce_scatter_base_": ("reduce-scatter", 1),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce-scatter", 1),
    "c10d.allgather_": ("all-gather", 1),
    "c10d._allgather_base_": ("all-gather", 1),
    "c10d.allgather_coalesced_": ("all-gather", 1),
    "c10d.allgather_into_tensor_coalesced_": ("all-gather", 1),
    "c10d.broadcast_": ("broadcast", 0),
    "c10d.reduce_": ("reduce", 0),
    "c10d.gather_": ("gather", 1),
    "c10d.scatter_": ("scatter", 1),
    "c10d.alltoall_": ("all-to-all", 1),
    "c10d.alltoall_base_": ("all-to-all", 1),
    "c10d.send": ("send", 0),
    "c10d.recv_": ("recv", 0),
    "c10d.recv_any_source_": ("recv", 0),
}
POINT_TO_POINT = ("send", "recv")


def _tensors(arg) -> List[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    return [t for a in arg for t in _tensors(a)]       # a list of tensors (or of lists)


def _async_op(func, args, kwargs) -> Optional[bool]:
    """The op's ``async_op`` as the caller set it (the schema's default where left out);
    ``None`` for an op without one (a point-to-point message: always asynchronous)."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == "async_op":
            if i < len(args):
                return bool(args[i])
            return bool(kwargs.get("async_op", argument.default_value))
    return None


@dataclasses.dataclass
class C10dCall:
    """One c10d operation: ``what`` (``"all-reduce"``, ``"send"``, ...), ``tensors`` (this
    rank's input: the caller's own tensors, or the copies :mod:`mpu_lab.core.comm` sends),
    ``nbytes`` (theirs), ``is_async`` (``async_op``; ``None`` for a message)."""
    what: str
    tensors: List[torch.Tensor]
    nbytes: int
    is_async: Optional[bool]


class C10dCalls(CollectiveLog):
    """``with C10dCalls() as calls:`` — every c10d collective and message run while open, in
    ``calls.calls`` (:class:`C10dCall`, in order); ``CollectiveLog``'s and ``CommDebugMode``'s
    own tables too. See the module docstring for ``on_call``."""

    def __init__(self, on_call: Optional[Callable[[C10dCall], None]] = None):
        super().__init__()
        self.calls: List[C10dCall] = []
        self._on_call = on_call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = OPS.get(str(getattr(func, "_overloadpacket", "")))
        if op is not None:
            tensors = _tensors(args[op[1]])
            call = C10dCall(op[0], tensors, sum(t.numel() * t.element_size() for t in tensors),
                            _async_op(func, args, kwargs or {}))
            self.calls.append(call)
            if self._on_call is not None:
                self._on_call(call)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def collectives(self) -> List[str]:
        """What each collective (not a message) did, in order: ``["all-reduce", ...]``."""
        return [c.what for c in self.calls if c.what not in POINT_TO_POINT]

    def sent_bytes(self) -> int:
        """Bytes of every tensor sent point-to-point."""
        return sum(c.nbytes for c in self.calls if c.what == "send")
