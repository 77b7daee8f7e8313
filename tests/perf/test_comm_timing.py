"""Timing installed from outside the mirror (mpu_lab.perf.comm_timing, step_timer and
linear_overlap's recorder), in a one-rank gloo world: the wrappers exist only while a timer is
open, every call is booked with what was passed to it, no_overlap() finishes an async
collective before it returns, and one recorded backward of Megatron's linear holds the GEMMs
and collectives its docstring lists, in that order."""
import time

import pytest
import torch
import torch.nn.functional as F

from mpu_lab.core import comm, parallel_state
from mpu_lab.perf import comm_timing, linear_overlap, step_timer
from mpu_lab.core.pipeline_parallel import p2p_communication
from mpu_lab.core.tensor_parallel.linear_autograd import (
    linear_with_grad_accumulation_and_async_allreduce)
from mpu_lab.training import training


def test_wrappers_are_installed_only_while_a_timer_is_open(world):
    names = comm_timing.BLOCKING + comm_timing.ASYNC
    originals = {name: getattr(comm_timing.HOME[name], name) for name in names}
    communicate = p2p_communication.communicate
    with comm_timing.CommTimer():
        with comm_timing.no_overlap():
            assert comm.all_reduce is not originals["all_reduce"]
        assert comm.all_reduce_async is not originals["all_reduce_async"]
    assert {name: getattr(comm_timing.HOME[name], name) for name in names} == originals
    assert p2p_communication.communicate is communicate


def test_every_call_is_booked_with_its_kind_size_and_tensor(world):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with comm_timing.CommTimer() as outer, comm_timing.CommTimer() as inner:
        total = comm.all_reduce(x)
        gathered = comm.all_gather(x, dim=1)
        pending = comm.all_reduce_async(x)
        assert pending.call.done_s is None            # in flight until someone waits
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


def test_no_overlap_waits_before_the_async_call_returns(world):
    x = torch.ones(8)
    with comm_timing.CommTimer() as timer:
        overlapped = comm.all_reduce_async(x)
        between = time.perf_counter()
        overlapped.wait()
        with comm_timing.no_overlap():
            serial = comm.all_reduce_async(x)
            between_serial = time.perf_counter()
            assert torch.equal(serial.wait(), x)
    first, second = timer.calls
    assert first.done_s > between                     # waited for after the caller went on
    assert second.done_s <= between_serial            # finished before the call returned


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


def _recorded_backward(weights, group, x, dy):
    h = linear_with_grad_accumulation_and_async_allreduce(x, weights[0], None,
                                                          sequence_parallel=True, group=group)
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
    with comm_timing.no_overlap():
        serial = _recorded_backward(weights, group, x, dy)
    assert linear_overlap.in_flight(serial) == [("all-gather X", []), ("reduce-scatter dX", [])]


def test_the_step_timer_wraps_train_step_from_outside_and_puts_it_back(world, monkeypatch):
    ran = []
    monkeypatch.setattr(training, "train_step", lambda state: ran.append(state) or {})
    fake = training.train_step
    timer = step_timer.StepTimer(skip=1)
    with step_timer.timing_train_steps(timer):
        assert training.train_step is not fake      # what train()'s loop calls now
        for state in range(3):
            training.train_step(state)
    assert training.train_step is fake and ran == [0, 1, 2]
    assert len(timer.step_seconds) == 2               # the first step is not timed
    assert timer.report()["steps"] == 2


def test_step_timer_for_follows_the_breakdown_flags(world):
    class Args:
        breakdown, breakdown_barrier, breakdown_profile = False, False, None
    assert step_timer.step_timer_for(Args) is None
    Args.breakdown_barrier = True
    timer = step_timer.step_timer_for(Args)
    assert timer.barrier and timer.skip == 1 and timer.profile_dir is None
