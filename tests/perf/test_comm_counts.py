"""mpu_lab.perf.comm_counts in one process: torch's CommDebugMode, with each collective's
kind, module, pass, group and bytes, on a one-rank gloo world (a collective on a group of
one still goes through c10d, so CommDebugMode sees it)."""
import pytest
import torch

from mpu_lab.core import comm
from mpu_lab.perf.comm_counts import CollectiveLog, expected_layer_counts, format_collectives

pytestmark = pytest.mark.usefixtures("world")   # a one-rank world (tests/conftest.py)


class _ReduceBothWays(torch.autograd.Function):
    """All-reduce in forward and again in backward (``g`` followed by ``f``)."""

    @staticmethod
    def forward(ctx, x):
        return comm.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return _ReduceBothWays.apply(self.linear(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = Block(), Block()

    def forward(self, x):
        return self.second(self.first(x))


def test_each_collective_is_logged_with_module_pass_group_and_bytes():
    net, x = Net(), torch.randn(3, 4)
    with CollectiveLog() as log:
        net(x).sum().backward()
    assert [(e["module"], e["backward"]) for e in log.events] == [
        ("Net.first", False), ("Net.second", False), ("Net.second", True), ("Net.first", True)]
    assert all(e["kind"] == "all_reduce" and e["group"] == [0] for e in log.events)
    assert all(e["bytes"] == 3 * 4 * 4 for e in log.events)          # [3, 4] fp32
    assert log.count("all_reduce", backward=True) == 2
    counts = log.comm_module_counts["Net.first"]                      # CommDebugMode's own table
    assert sum(counts["forward"].values()) == 1 and sum(counts["backward"].values()) == 1


def test_modules_may_run_many_times_inside_one_log_and_no_hook_is_left_behind():
    # torch's tracker alone raises IndexError when a module runs twice inside one mode
    net, x = Net(), torch.randn(3, 4)
    with CollectiveLog() as log:
        for _ in range(3):
            net(x).sum().backward()
    assert log.count() == 12
    assert all(not m._forward_hooks for m in net.modules())


def test_the_analysis_and_the_table():
    assert expected_layer_counts(False, 2) == {"forward": {"all_reduce": 2},
                                               "backward": {"all_reduce": 2}}
    events = [dict(step=0, tag="layer0.forward", kind="all_reduce", group=[0, 1], bytes=1024)] * 2
    assert format_collectives(events).splitlines()[1].split() == [
        "layer0.forward", "all_reduce", "[0,", "1]", "2", "2048"]
