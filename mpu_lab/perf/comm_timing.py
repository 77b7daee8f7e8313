"""Time the collectives of :mod:`mpu_lab.core.comm` and the pipeline's p2p messages, from outside.

The mirror carries no timer: while a :class:`CommTimer` is active (``with CommTimer() as
timer:``), the functions of :mod:`mpu_lab.core.comm` (``all_reduce``, ``all_gather``,
``reduce_scatter``, ``broadcast``, ``all_to_all``, ``send_recv`` and the ``*_async`` ones) and
``pipeline_parallel.p2p_communication.communicate`` are replaced by timing wrappers, and put
back when the last timer closes. Every caller in the package calls them as ``comm.all_reduce``
or ``exchange.all_to_all`` (a lookup on the module at call time), so the wrappers see every call.

What a call's time means: a blocking collective returns when the *last* rank of its group has
arrived, so its time is the transfer plus the wait for the slowest peer (for p2p, for the
neighbouring stage: the pipeline bubble, Narayanan et al. 2021 §2.2). With ``barrier=True`` a
barrier on the group runs first and is booked apart (``barrier_s``): what remains is closer to
the transfer itself (Megatron's timers offer the same switch, ``--barrier-with-L1-time``). For
an asynchronous collective the caller pays only the time spent in ``wait()``: the part of the
transfer its own computation did not hide. On CUDA each blocking call is bracketed by
``torch.cuda.synchronize()`` so queued kernels are not billed to it (that removes overlap).

:func:`no_overlap` is the baseline that shows what overlapping saves: inside it every
``*_async`` collective is waited for before it returns.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import threading
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from mpu_lab.core import comm, parallel_state
from mpu_lab.training import initialize
from mpu_lab.core.comm import exchange
from mpu_lab.core.pipeline_parallel import p2p_communication

# The functions of mpu_lab.core.comm and mpu_lab.core.comm.exchange that are wrapped, and their module.
BLOCKING = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")
ASYNC = ("all_reduce_async", "all_gather_async", "reduce_scatter_async", "send_recv_async")
HOME = {name: exchange if hasattr(exchange, name) else comm for name in BLOCKING + ASYNC}
P2P = "communicate"     # the one function every p2p_communication call goes through


@dataclasses.dataclass
class CommCall:
    """One call, with ``time.perf_counter()`` stamps. ``seconds``: what the caller paid (the
    blocking call, or the time in ``wait()``); ``issued_s``: when it was called; ``done_s``:
    when it returned (blocking) or its ``wait()`` returned (async, ``None`` until then);
    ``completed_s``: when the backend finished an async one (its future), even if nobody
    waited yet. ``data_ptr``: the address of the caller's tensor (which buffer it reduced)."""
    kind: str
    ranks: tuple
    numel: int
    nbytes: int
    data_ptr: int
    is_async: bool
    issued_s: float
    seconds: float = 0.0
    barrier_s: float = 0.0
    done_s: Optional[float] = None
    completed_s: Optional[float] = None


class CommTimer:
    """Records a :class:`CommCall` for every collective and p2p call while it is active
    (``calls``, in the order they were issued). Timers may nest: each records every call."""

    def __init__(self, barrier: bool = False):
        self.barrier = barrier
        self.calls: List[CommCall] = []

    def __enter__(self):
        _observe(+1)
        _TIMERS.append(self)
        return self

    def __exit__(self, *exc):
        _TIMERS.remove(self)
        _observe(-1)
        return False

    def seconds(self) -> float:
        """Everything booked so far, barriers included."""
        return sum(c.seconds + c.barrier_s for c in self.calls)


@contextlib.contextmanager
def no_overlap():
    """Inside the block every ``*_async`` collective is finished before it returns, so
    nothing overlaps it."""
    _observe(+1)
    _SERIAL.append(True)
    try:
        yield
    finally:
        _SERIAL.pop()
        _observe(-1)


# --------------------------------------------------------------------------- the wrappers
_TIMERS: List[CommTimer] = []
_SERIAL: List[bool] = []
_ORIGINALS: Dict[str, Callable] = {}
_OBSERVERS = [0]
# Set while a wrapped call runs: a collective built on another one (a blocking call that waits
# for its async twin) is booked once, as the outer call.
_INSIDE = threading.local()


def _observe(delta: int) -> None:
    """Install the wrappers when the first observer arrives, restore the originals when the
    last one leaves."""
    if _OBSERVERS[0] == 0 and delta > 0:
        for name in BLOCKING + ASYNC:
            _ORIGINALS[name] = getattr(HOME[name], name)
            wrap = _blocking if name in BLOCKING else _async
            setattr(HOME[name], name, wrap(name.replace("_async", ""), _ORIGINALS[name]))
        _ORIGINALS[P2P] = getattr(p2p_communication, P2P)
        setattr(p2p_communication, P2P, _p2p(_ORIGINALS[P2P]))
    _OBSERVERS[0] += delta
    if _OBSERVERS[0] == 0:
        for name, fn in _ORIGINALS.items():
            setattr(p2p_communication if name == P2P else HOME[name], name, fn)
        _ORIGINALS.clear()


def _ranks(group) -> tuple:
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _call_of(kind: str, fn: Callable, args, kwargs, is_async: bool):
    """``(CommCall, group)`` for a call of ``fn`` (its tensor is the first argument)."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    tensor, group = args[0] if args else kwargs["tensor"], bound.arguments.get("group")
    call = CommCall(kind, _ranks(group), tensor.numel(), tensor.numel() * tensor.element_size(),
                    tensor.data_ptr(), is_async, time.perf_counter())
    return call, group, tensor


@contextlib.contextmanager
def _inside():
    _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
    try:
        yield
    finally:
        _INSIDE.depth -= 1


def _nested() -> bool:
    return getattr(_INSIDE, "depth", 0) > 0


def _blocking(kind: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if not _TIMERS or _nested():
            return fn(*args, **kwargs)
        call, group, tensor = _call_of(kind, fn, args, kwargs, is_async=False)
        initialize.synchronize(tensor.device)
        if any(t.barrier for t in _TIMERS):
            start = time.perf_counter()
            dist.barrier(group=group)
            call.barrier_s = time.perf_counter() - start
        start = time.perf_counter()
        with _inside():
            out = fn(*args, **kwargs)
        initialize.synchronize(tensor.device)
        call.done_s = time.perf_counter()
        call.seconds = call.done_s - start
        _book(call)
        return out
    return timed


class TimedPending:
    """What a wrapped ``*_async`` call returns: the mirror's :class:`mpu_lab.core.comm.Pending`, its
    ``wait()`` timed into ``call``."""

    def __init__(self, pending: comm.Pending, call: Optional[CommCall]):
        self.pending, self.call = pending, call
        if call is not None:
            try:
                pending.work.get_future().add_done_callback(self._completed)
            except (AttributeError, RuntimeError):    # some Work kinds have no future
                pass

    def _completed(self, _future) -> None:
        if self.call.completed_s is None:
            self.call.completed_s = time.perf_counter()

    def __getattr__(self, name):
        return getattr(self.pending, name)

    def wait(self) -> torch.Tensor:
        if self.call is None or self.call.done_s is not None:
            return self.pending.wait()
        start = time.perf_counter()
        out = self.pending.wait()
        self.call.done_s = time.perf_counter()
        self.call.seconds = self.call.done_s - start
        if self.call.completed_s is None or self.call.completed_s > self.call.done_s:
            self.call.completed_s = self.call.done_s
        return out


def _async(kind: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def started(*args, **kwargs):
        if _nested():
            return fn(*args, **kwargs)
        call = _call_of(kind, fn, args, kwargs, is_async=True)[0] if _TIMERS else None
        with _inside():
            pending = TimedPending(fn(*args, **kwargs), call)
        if call is not None:
            _book(call)
        if _SERIAL:                 # no_overlap(): done before the caller computes anything
            pending.wait()
        return pending
    return started


def _p2p(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def timed(**kwargs):
        if not _TIMERS:
            return fn(**kwargs)
        messages = sum(kwargs.get(k) is not None for k in ("tensor_send_next", "tensor_send_prev"))
        messages += sum(bool(kwargs.get(k)) for k in ("recv_prev", "recv_next"))
        numel = math.prod(kwargs.get("tensor_shape") or ()) * messages
        dtype = kwargs.get("dtype", torch.float32)
        group = parallel_state.get_pipeline_model_parallel_group()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()    # queued kernels are not billed to the messages
        call = CommCall("p2p", _ranks(group), numel, numel * dtype.itemsize, 0,
                        False, time.perf_counter())
        with _inside():
            out = fn(**kwargs)      # communicate() waits for its messages before it returns
        call.done_s = time.perf_counter()
        call.seconds = call.done_s - call.issued_s
        if messages:
            _book(call)
        return out
    return timed


def _book(call: CommCall) -> None:
    for timer in _TIMERS:
        timer.calls.append(call)
