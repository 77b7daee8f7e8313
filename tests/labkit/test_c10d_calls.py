"""mpu_lab.labkit.c10d_calls in one process (a one-rank gloo world): what a function
called is seen at torch's dispatcher, however it called it — ``torch.distributed`` directly or
``mpu_lab.core.comm`` — with its ``async_op``, and the bytes it sent."""
import pytest
import torch
import torch.distributed as dist

from mpu_lab.core import comm
from mpu_lab.labkit.c10d_calls import C10dCalls


@pytest.mark.filterwarnings("ignore:`torch.distributed.all_gather_into_tensor` is deprecated")
def test_each_collective_is_named_once_whichever_api_called_it(world):
    x = torch.arange(4.0)
    with C10dCalls() as calls:
        dist.all_reduce(x)
        dist.all_reduce(x, async_op=True).wait()
        comm.reduce_scatter(x)                                # a copy goes to c10d
        dist.all_gather_into_tensor(torch.empty(4), x)
        comm.all_gather(x)
        dist.broadcast(x, 0)
    assert calls.collectives() == ["all-reduce", "all-reduce", "reduce-scatter", "all-gather",
                                   "all-gather", "broadcast"]
    assert [c.is_async for c in calls.calls[:2]] == [False, True]
    assert calls.calls[0].tensors[0].data_ptr() == x.data_ptr()     # the caller's own tensor
    assert calls.calls[2].tensors[0].data_ptr() != x.data_ptr()     # comm's copy
    assert [c.nbytes for c in calls.calls] == [16] * 6
    assert calls.sent_bytes() == 0


def test_on_call_runs_as_each_call_is_dispatched(world):
    x, order = torch.ones(3), []
    with C10dCalls(on_call=lambda call: order.append(call.what)):
        order.append("before")
        dist.all_reduce(x)
        order.append("between")
        comm.broadcast(x, 0)
    dist.all_reduce(x)                                           # after the block: not seen
    assert order == ["before", "all-reduce", "between", "broadcast"]
