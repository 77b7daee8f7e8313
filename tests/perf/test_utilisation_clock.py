"""Each rank's busy and idle time from its own CPU clock (mpu_lab.perf.rank_clock), read from
outside by the utilisation sampler, against the workload's own account of itself.

The workload is a child process that computes and sleeps in turns: it spins until its own
thread clock (``time.thread_time()``, clock_gettime of the thread's CPU clock inside the
process) has advanced by a fixed amount, then sleeps. It prints what its clock and the wall
clock said. The sampler reads ``/proc`` from another process, in clock ticks: a second method.
Other processes on a loaded machine stretch the wall time but not the child's CPU time.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from mpu_lab.perf import rank_clock
from mpu_lab.perf.utilisation import Utilisation, UtilisationSampler

LINUX = sys.platform.startswith("linux")
TICK = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

# compute `busy` CPU seconds, then sleep `idle` seconds, `rounds` times; print own account
WORKLOAD = """
import json, sys, time
busy, idle, rounds = map(float, sys.argv[1:4])
sys.stdin.readline()                       # wait until the sampler has found us
c0, w0 = time.thread_time(), time.time()
for _ in range(int(rounds)):
    start = time.thread_time()
    while time.thread_time() - start < busy:
        pass
    time.sleep(idle)
print(json.dumps(dict(cpu_s=time.thread_time() - c0, start=w0, end=time.time())), flush=True)
sys.stdin.readline()                       # let the sampler take a sample after the end
"""


def _start_worker(busy, idle, rounds, rank=0):
    env = dict(os.environ, ROLE_RANK=str(rank), RANK=str(rank), LOCAL_RANK=str(rank))
    return subprocess.Popen([sys.executable, "-c", WORKLOAD, str(busy), str(idle), str(rounds)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _wait_found(sampler, n, timeout=10.0):
    deadline = time.time() + timeout
    while len(sampler.cpu_seconds) < n or any(v[-1] != v[-1] for v in sampler.cpu_seconds.values()):
        assert time.time() < deadline, "the sampler did not find the worker"
        time.sleep(0.02)


def test_busy_between_interpolates_the_clock_at_the_window_edges():
    # clock samples at t = 0, 1, 2, 3 s: 0, 0.5, 0.5, 1.5 s of CPU. Window [0.5, 2.5]:
    # clock 0.25 at 0.5 (halfway from 0 to 0.5), 1.0 at 2.5 (halfway from 0.5 to 1.5)
    b = rank_clock.busy_between(3, [0.0, 1.0, 2.0, 3.0], [0.0, 0.5, 0.5, 1.5], 0.5, 2.5)
    assert (b.rank, b.wall_s, b.busy_s) == (3, 2.0, 0.75)
    assert b.idle_s == 1.25 and b.busy_share == 0.375
    nan = float("nan")   # a rank found late: its first samples are NaN and skipped
    assert rank_clock.busy_between(0, [0, 1, 2], [nan, 1.0, 2.0], 1.0, 2.0).busy_s == 1.0


def test_busy_between_refuses_a_window_it_cannot_see():
    with pytest.raises(ValueError, match=r"window \[0.000, 5.000\] reaches beyond the samples"):
        rank_clock.busy_between(0, [0.0, 1.0], [0.0, 1.0], 0.0, 5.0)
    with pytest.raises(ValueError, match="must end after it starts: start=1.0, end=1.0"):
        rank_clock.busy_between(0, [0.0, 2.0], [0.0, 1.0], 1.0, 1.0)
    with pytest.raises(ValueError, match="rank 2: 1 clock samples; need at least 2"):
        rank_clock.busy_between(2, [0.0], [0.0], 0.0, 1.0)


def test_cores_note_speaks_only_when_ranks_outnumber_cores():
    assert rank_clock.cores_note(2, cores=2) is None
    note = rank_clock.cores_note(4, cores=2)
    assert note.startswith("this machine has 2 usable CPU cores for 4 ranks")
    assert "run at most 2 ranks" in note
    assert rank_clock.core_for(3, [4, 6]) == 6 and rank_clock.core_for(0, [4, 6]) == 4
    with pytest.raises(ValueError, match="local_rank must be >= 0, got -1"):
        rank_clock.core_for(-1, [0])


@pytest.mark.skipif(not LINUX, reason="the per-thread clock and pinning are Linux's")
def test_main_thread_clock_read_from_outside_agrees_with_the_process_own_clock():
    child = _start_worker(busy=0.05, idle=0.05, rounds=6)
    try:
        time.sleep(0.2)
        before = rank_clock.main_thread_cpu_s(child.pid)
        child.stdin.write("\n")
        child.stdin.flush()
        own = json.loads(child.stdout.readline())
        after = rank_clock.main_thread_cpu_s(child.pid)
        child.stdin.write("\n")
        child.stdin.flush()
    finally:
        child.wait(timeout=10)
    assert own["cpu_s"] == pytest.approx(0.3, abs=0.02)       # it spun 6 x 50 ms
    # the outside reading counts whole ticks, plus the few instructions around the loop
    assert after - before == pytest.approx(own["cpu_s"], abs=3 * TICK)
    with pytest.raises(ProcessLookupError):
        rank_clock.main_thread_cpu_s(child.pid)


@pytest.mark.skipif(not LINUX, reason="the per-thread clock and pinning are Linux's")
def test_sampler_pins_a_worker_and_measures_its_busy_and_idle_time():
    child = _start_worker(busy=0.04, idle=0.06, rounds=8)
    try:
        with UtilisationSampler(interval_s=0.02, gpu=False, cpu_metric="clock", pin=True) as s:
            _wait_found(s, 1)
            child.stdin.write("\n")
            child.stdin.flush()
            own = json.loads(child.stdout.readline())
            time.sleep(0.1)
            affinity = os.sched_getaffinity(child.pid)
            child.stdin.write("\n")
            child.stdin.flush()
            child.wait(timeout=10)
        util = s.result()
    finally:
        if child.poll() is None:
            child.kill()
    core = rank_clock.core_for(0)
    assert util.kind == "clock" and util.pinned == {0: core} and affinity == {core}
    window = util.crop(own["start"], own["end"])
    (busy,) = window.busy()
    assert busy.wall_s == pytest.approx(own["end"] - own["start"])
    # the child's own thread clock against the sampler's reading of /proc, interpolated at the
    # window's edges (samples every 20 ms, the clock in 10 ms ticks)
    assert busy.busy_s == pytest.approx(own["cpu_s"], abs=4 * TICK)
    assert own["cpu_s"] == pytest.approx(0.32, abs=0.02)      # 8 x 40 ms
    assert busy.idle_s == pytest.approx(busy.wall_s - own["cpu_s"], abs=4 * TICK)
    # the per-sample percentages stay within one core
    values = [v for v in window.values[0] if v == v]
    assert values and all(0 <= v <= 100 + 100 * TICK / 0.02 for v in values)


def test_busy_needs_the_clock_metric():
    util = Utilisation("runnable", 0.1, [0.0, 0.1], {0: [100.0, 0.0]}, 2)
    with pytest.raises(ValueError, match="sample with cpu_metric='clock' \\(this is 'runnable'\\)"):
        util.busy()
    with pytest.raises(ValueError, match="cpu_metric must be 'cpu', 'runnable' or 'clock', got 'x'"):
        UtilisationSampler(cpu_metric="x", gpu=False)
