"""How a soft restart decides that an engine is stuck (``World._busy``), without engines: the
hub's queue counts are given as a sequence. A count that clears within the settle time (the
hub learning late that a cell ended) keeps the restart soft; one that stays means a stuck
engine, and the engines are replaced."""
import time

from mpu_lab.labkit.playground import world as world_module


def _world_reporting(counts):
    w = world_module.World.__new__(world_module.World)
    seen = iter(counts)
    last = []

    def queues():
        last[:] = [next(seen, last[0] if last else [0])]
        return last[0]

    w._queues = queues
    return w


def test_a_finished_cell_the_hub_still_counts_keeps_the_restart_soft():
    w = _world_reporting([[1, 0], [1, 0], [0, 0]])
    assert w._busy(settle_s=2.0) is False


def test_an_engine_still_busy_after_the_settle_time_is_stuck():
    w = _world_reporting([[0, 1]] * 1000)
    start = time.monotonic()
    assert w._busy(settle_s=0.3) is True
    assert 0.3 <= time.monotonic() - start < 2.0


def test_idle_engines_are_not_waited_for():
    w = _world_reporting([[0, 0]])
    start = time.monotonic()
    assert w._busy(settle_s=5.0) is False
    assert time.monotonic() - start < 0.5
