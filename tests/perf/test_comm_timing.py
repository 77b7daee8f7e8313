"""Timing from outside the mirror (mpu_lab.perf.comm_timing through mpu_lab.core.comm's hook
point, breakdown's StepTimer and linear_overlap's recorder), in a one-rank gloo world: the hook is
registered only while a timer is open and no function is replaced, every call is booked once
with what was passed to it, an async call's wait is stamped when the caller waits, the serial
switch of Megatron's linear (async_comm=False) finishes each collective before the next GEMM,
and one recorded backward holds the GEMMs and collectives its docstring lists, in that order."""
import contextlib
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from mpu_lab.core import comm, parallel_state
from mpu_lab.core.comm import exchange, hooks
from mpu_lab.perf import breakdown, comm_timing, linear_overlap
from mpu_lab.core.tensor_parallel.linear_autograd import (
    linear_with_grad_accumulation_and_async_allreduce)

FUNCTIONS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_reduce_async",
             "all_gather_async", "reduce_scatter_async")


class Log(hooks.CommHook):
    """A hook of the test's own: notes (phase, kind, is_async) as comm reports them."""

    def __init__(self):
        self.seen = []

    @contextlib.contextmanager
    def call(self, call):
        self.seen.append(("call", call.kind, call.is_async))
        yield
        assert call.works or not call.is_async        # an async call is issued on exit

    @contextlib.contextmanager
    def wait(self, call):
        self.seen.append(("wait", call.kind, call.is_async))
        yield


def test_comm_reports_each_call_once_to_a_registered_hook_until_removed(world):
    x = torch.ones(4)
    log = Log()
    handle = hooks.register_comm_hook(log)
    try:
        comm.all_reduce(x)                  # built on all_reduce_async + wait: reported once
        pending = comm.all_gather_async(x)
        pending.wait()
        pending.wait()                      # the result is kept: waited for once
        exchange.all_to_all(x)
    finally:
        handle.remove()
    comm.all_reduce(x)
    assert log.seen == [("call", "all_reduce", False), ("call", "all_gather", True),
                        ("wait", "all_gather", True), ("call", "all_to_all", False)]


def test_the_hook_is_registered_only_while_a_timer_is_open_and_nothing_is_replaced(world):
    functions = {name: getattr(comm, name) for name in FUNCTIONS}
    assert hooks.quiet()                               # no hook registered
    with comm_timing.CommTimer() as timer, comm_timing.CommTimer():
        assert not hooks.quiet()
        assert {name: getattr(comm, name) for name in FUNCTIONS} == functions
        comm.all_reduce(torch.ones(2))
    assert hooks.quiet()                               # the hook left with the last timer
    comm.all_reduce(torch.ones(2))
    assert len(timer.calls) == 1                       # not booked once the timer closed


def test_every_call_is_booked_with_its_kind_size_and_tensor(world):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with comm_timing.CommTimer() as outer, comm_timing.CommTimer() as inner:
        total = comm.all_reduce(x)
        gathered = comm.all_gather(x, dim=1)
        pending = comm.all_reduce_async(x)
        assert outer.calls[-1].done_s is None         # in flight until someone waits
        result = pending.wait()
    assert torch.equal(total, x) and torch.equal(result, x) and gathered.shape == (3, 4)
    assert outer.calls == inner.calls                 # nested timers each see every call
    calls = outer.calls
    assert [(c.kind, c.is_async) for c in calls] == [("all_reduce", False),
                                                     ("all_gather", False),
                                                     ("all_reduce", True)]
    for c in calls:
        assert (c.ranks, c.numel, c.nbytes, c.data_ptr) == ((0,), 12, 48, x.data_ptr())
        assert c.seconds >= 0 and c.issued_s <= c.done_s
    assert calls[2].completed_s <= calls[2].done_s
    assert outer.seconds() == pytest.approx(sum(c.seconds for c in calls))


def test_an_async_call_is_stamped_done_when_the_caller_waits(world):
    x = torch.ones(8)
    with comm_timing.CommTimer() as timer:
        overlapped = comm.all_reduce_async(x)
        between = time.perf_counter()
        time.sleep(0.01)                              # the caller computes meanwhile
        overlapped.wait()
    (call,) = timer.calls
    assert call.issued_s < between < call.done_s      # waited for after the caller went on
    assert call.seconds < call.done_s - call.issued_s  # the caller paid only the wait
    assert call.completed_s <= call.done_s



def test_closing_the_timer_waits_until_the_backend_has_run_and_dropped_its_callbacks(world):
    """gloo runs a completion callback on its own thread after it has woken the waiting rank;
    had that thread not run and dropped it when the interpreter shuts down, it would take the
    GIL of a finalizing interpreter and abort the process. A real torch future completed by
    another thread 50 ms later stands for the backend's: the drain returns only after the
    callback ran and was dropped; a future that does not complete in time is given up after
    the timeout, and counted."""
    ran = []
    late = torch.futures.Future()

    def callback(_future):
        ran.append(time.perf_counter())
    late.add_done_callback(callback)
    comm_timing.watch_callback(callback)
    del callback                                  # only the future holds it, as for a call
    start = time.perf_counter()
    threading.Timer(0.05, late.set_result, args=(None,)).start()
    assert comm_timing.drain_callbacks() == 0
    assert ran and time.perf_counter() - start >= 0.05

    stuck = torch.futures.Future()
    pending = lambda _future: None                  # noqa: E731
    stuck.add_done_callback(pending)
    comm_timing.watch_callback(pending)
    del pending
    start = time.perf_counter()
    assert comm_timing.drain_callbacks(timeout_s=0.05) == 1
    assert 0.05 <= time.perf_counter() - start < 1.0
    stuck.set_result(None)                          # runs and drops its callback
    assert comm_timing.pending_callbacks() == 0


def test_an_issued_call_leaves_no_callback_behind_once_its_timer_closes(world):
    with comm_timing.CommTimer():
        for _ in range(3):
            comm.all_reduce_async(torch.ones(1 << 16)).wait()
    assert comm_timing.pending_callbacks() == 0


def _two_linears(seq=8, batch=2, hidden=8):
    """Megatron's linear function twice, as a sequence-parallel MLP uses it (a one-rank
    tensor-parallel group: the layers themselves leave the collectives out at t = 1): the
    first re-gathers its input and reduce-scatters dX in backward, the second communicates
    nothing."""
    torch.manual_seed(0)
    group = parallel_state.get_tensor_model_parallel_group()
    w1, w2 = torch.randn(4 * hidden, hidden), torch.randn(hidden, 4 * hidden)
    x = torch.randn(seq, batch, hidden, requires_grad=True)
    return ((w1.requires_grad_(), w2.requires_grad_()), group, x,
            torch.randn(seq, batch, hidden))


def _recorded_backward(weights, group, x, dy, async_comm=True):
    h = linear_with_grad_accumulation_and_async_allreduce(x, weights[0], None,
                                                          sequence_parallel=True, group=group,
                                                          async_comm=async_comm)
    y = linear_with_grad_accumulation_and_async_allreduce(F.gelu(h), weights[1], None)
    with linear_overlap.record_backward() as events:
        y.backward(dy)
    return events


def test_one_backward_holds_the_steps_of_the_linear_docstring_in_order(world):
    weights, group, x, dy = _two_linears()
    events = _recorded_backward(weights, group, x, dy)
    # the second linear first (two GEMMs, no collective inside it), then the first one, as
    # linear_autograd's docstring lists its steps: re-gather X (async), dX, reduce-scatter dX
    # (async), dW
    assert [e[0] for e in events] == ["dX = dY W", "dW = dY^T X", "all-gather X", "dX = dY W",
                                      "reduce-scatter dX", "dW = dY^T X"]
    assert linear_overlap.in_flight(events) == [("all-gather X", ["dX = dY W"]),
                                                ("reduce-scatter dX", ["dW = dY^T X"])]
    serial = _recorded_backward(weights, group, x, dy, async_comm=False)
    assert linear_overlap.in_flight(serial) == [("all-gather X", []), ("reduce-scatter dX", [])]


def test_the_step_timer_times_the_steps_after_the_first_and_their_collectives(world):
    timer = breakdown.StepTimer(skip=1)
    for _ in range(3):                               # as train()'s loop calls its callbacks
        timer.on_step_begin()
        comm.all_reduce(torch.ones(4))
        timer.on_step_end()
    assert len(timer.step_seconds) == 2               # the first step is not timed
    assert [c.kind for c in timer.comm_timer.calls] == ["all_reduce"] * 2
    report = timer.report()
    assert report["steps"] == 2
    assert report["calls"] == {"other": 1.0}          # a one-rank group is no family's


def test_step_timer_for_follows_the_breakdown_flags(world):
    class Args:
        breakdown, breakdown_barrier, breakdown_profile = False, False, None
    assert breakdown.step_timer_for(Args) is None
    Args.breakdown_barrier = True
    timer = breakdown.step_timer_for(Args)
    assert timer.barrier and timer.skip == 1 and timer.profile_dir is None
