"""Time the collectives of :mod:`mpu_lab.core.comm` and the pipeline's p2p messages, from outside.

The mirror carries no timer. While a :class:`CommTimer` is open (``with CommTimer() as
timer:``), one :class:`~mpu_lab.core.comm.hooks.CommHook` is registered at the hook point of
:mod:`mpu_lab.core.comm` (:func:`~mpu_lab.core.comm.hooks.register_comm_hook`), which is told of
every call of the package: the collectives, the ``*_async`` ones and their ``wait()``, the
all-to-all and ring exchanges, and the pipeline's messages (``p2p_communication.communicate``
posts them through :func:`mpu_lab.core.comm.exchange.isend_irecv`: one ``p2p`` call). The hook
is removed when the last timer closes; no function is replaced.

Why that hook rather than ``torch.profiler`` or ``CommDebugMode``: both see the backend's c10d
ops, but not the caller's side that the labs read: the caller's own tensor (DDP's bucket,
found by its address; the ops see a staged copy), a pipeline step as one call (it is several
sends and receives), the group as the caller named it, and above all when the caller *waited*
for an async result, which is what overlap is about (``Work.wait()`` is no op of the
dispatcher, and the profiler's trace has no caller-side wait span nor group ranks to read back
in Python). The profiler's trace is kept for what it shows best, kernels and threads
(``StepTimer(profile_dir=...)``, :mod:`mpu_lab.perf.kernel_timeline`); collectives are counted
with ``CommDebugMode`` (:mod:`mpu_lab.perf.comm_counts`).

What a call's time means: a blocking collective returns when the *last* rank of its group has
arrived, so its time is the transfer plus the wait for the slowest peer (for p2p, for the
neighbouring stage: the pipeline bubble, Narayanan et al. 2021 §2.2). With ``barrier=True`` a
barrier on the group runs first and is booked apart (``barrier_s``; not before a p2p call,
whose peer is one neighbour): what remains is closer to the transfer itself (Megatron's timers
offer the same switch, ``--barrier-with-L1-time``). For an asynchronous collective the caller
pays only the time spent in ``wait()``: the part of the transfer its own computation did not
hide. On CUDA each blocking call is bracketed by ``torch.cuda.synchronize()`` so queued kernels
are not billed to it (that removes overlap).

The serial baseline that shows what overlapping saves is a switch of the layers, not of the
timer: ``ColumnParallelLinear.async_comm = False`` (Megatron's linear waiting for each of its
collectives at once) and DDP's ``overlap_grad_reduce``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from typing import List, Optional

import torch.distributed as dist

from mpu_lab.core.comm import hooks
from mpu_lab.training import initialize


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
        _BOOKING.open(self)
        return self

    def __exit__(self, *exc):
        _BOOKING.close(self)
        return False

    def seconds(self) -> float:
        """Everything booked so far, barriers included."""
        return sum(c.seconds + c.barrier_s for c in self.calls)


def _ranks(group) -> tuple:
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _record(call: hooks.Call) -> CommCall:
    numel = sum(t.numel() for t in call.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in call.tensors)
    first = call.tensors[0].data_ptr() if call.tensors else 0
    return CommCall(call.kind, _ranks(call.group), numel, nbytes, first, call.is_async,
                    time.perf_counter())


# How long closing the last timer waits for the backend to run the timer's completion
# callbacks (they run as soon as each async call finishes, which a waited-for call has).
DRAIN_TIMEOUT_S = 10.0


class _Booking(hooks.CommHook):
    """The one hook behind every open :class:`CommTimer`: registered with
    :mod:`mpu_lab.core.comm.hooks` while at least one timer is open; books each call into all of
    them (so nested timers hold the same records).

    An async call's completion time comes from a callback on its future, which gloo runs on its
    own worker thread, and only *after* it has woken the rank waiting for the call. The thread
    takes the GIL twice: to run the callback and to drop it (torch's wrapper of a Python
    callable). Had it not done both by the time the rank's interpreter shuts down, it would take
    the GIL of a finalizing interpreter, and the process aborts ("terminate called without an
    active exception", seen once in a DP-overlap job under the full suite). So closing the last
    timer waits, with the GIL released, until every callback it registered has been run and
    dropped (:func:`watch_callback`, :func:`drain_callbacks`)."""

    def __init__(self):
        self.timers: List[CommTimer] = []
        self.handle = None
        self.in_flight: "weakref.WeakKeyDictionary[hooks.Call, CommCall]" = \
            weakref.WeakKeyDictionary()
        self.lock = threading.Lock()

    def open(self, timer: CommTimer) -> None:
        if not self.timers:
            self.handle = hooks.register_comm_hook(self)
        self.timers.append(timer)

    def close(self, timer: CommTimer) -> None:
        self.timers.remove(timer)
        if not self.timers:
            self.handle.remove()
            self.handle = None
            drain_callbacks()

    def _book(self, record: CommCall) -> None:
        for timer in self.timers:
            timer.calls.append(record)

    def call(self, call: hooks.Call):
        return self._issue(call) if call.is_async else self._blocking(call)

    @contextlib.contextmanager
    def _blocking(self, call: hooks.Call):
        device = call.tensors[0].device if call.tensors else "cpu"
        initialize.synchronize(device)
        record = _record(call)
        if call.kind != "p2p" and any(t.barrier for t in self.timers):
            start = time.perf_counter()       # a pipeline message has no group to wait for
            dist.barrier(group=call.group)
            record.barrier_s = time.perf_counter() - start
        start = time.perf_counter()
        yield
        initialize.synchronize(device)
        record.done_s = time.perf_counter()
        record.seconds = record.done_s - start
        self._book(record)

    @contextlib.contextmanager
    def _issue(self, call: hooks.Call):
        record = _record(call)
        yield
        self.in_flight[call] = record
        self._book(record)
        left = [len(call.works)]

        def completed(_future) -> None:     # on the backend's thread, once per handle
            with self.lock:
                left[0] -= 1
                if left[0] == 0 and record.completed_s is None:
                    record.completed_s = time.perf_counter()
        for work in call.works:
            try:
                work.get_future().add_done_callback(completed)
            except (AttributeError, RuntimeError):    # some Work kinds have no future
                pass
        watch_callback(completed)   # from here on only the futures hold it

    @contextlib.contextmanager
    def wait(self, call: hooks.Call):
        record = self.in_flight.pop(call, None)
        start = time.perf_counter()
        yield
        if record is None:                  # issued before the first timer opened
            return
        record.done_s = time.perf_counter()
        record.seconds = record.done_s - start
        if record.completed_s is None or record.completed_s > record.done_s:
            record.completed_s = record.done_s


_CALLBACKS: List[weakref.ref] = []     # the callbacks given to futures, not yet dropped


def watch_callback(callback) -> None:
    """Count ``callback``, given to a backend's future and held by nothing else, as pending
    until the backend has run and dropped it (it dies then: a weak reference tells)."""
    _CALLBACKS.append(weakref.ref(callback))


def pending_callbacks() -> int:
    """How many watched callbacks the backend still holds."""
    _CALLBACKS[:] = [ref for ref in _CALLBACKS if ref() is not None]
    return len(_CALLBACKS)


def drain_callbacks(timeout_s: float = DRAIN_TIMEOUT_S) -> int:
    """Wait, with the GIL released, until the backend has run and dropped every watched
    callback, or ``timeout_s`` has passed (a call that never completes); return how many are
    left (0 but for such a call)."""
    deadline = time.perf_counter() + timeout_s
    while pending_callbacks() and time.perf_counter() <= deadline:
        time.sleep(0.001)           # releases the GIL for the backend's thread
    return pending_callbacks()


_BOOKING = _Booking()
