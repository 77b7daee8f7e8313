"""Each rank's own clock: how long it computed and how long it waited, and one core per rank.

A rank that waits — in a collective, in a pipeline receive, in a barrier — sleeps in the kernel,
and its main thread's CPU clock stands still (what ``time.thread_time()`` reads inside the rank;
``/proc/<pid>/task/<pid>/stat`` from outside). Over a window of ``wall`` seconds the rank was
therefore **busy** for the growth of that clock and **idle** for the rest. The reading needs no
help from the rank, and other processes do not enter it: a rank's clock only advances while
the rank itself runs.

It means "busy" only when the rank has a core to itself. Where ranks outnumber the cores, a
rank ready to compute may sit in the run queue while another rank holds the core: its clock
stands still although it is not waiting for a peer, and the waiting rank's core is lent out, so
a pipeline bubble costs little wall time. A timing lesson therefore runs no more ranks than
:func:`usable_cores` and pins each rank, all its threads, to a core of its own
(:func:`pin_process`; ``torch.set_num_threads(1)``, which the launcher arranges through
``OMP_NUM_THREADS``, keeps it to one core's worth of work).

Linux only for the pinning and the per-thread clock; elsewhere :func:`pin_process` says it
could not pin and :func:`main_thread_cpu_s` falls back to the whole process's CPU time.
"""
from __future__ import annotations

import dataclasses
import os
from bisect import bisect_left
from typing import List, Optional, Sequence

__all__ = ["usable_cores", "core_for", "pin_process", "main_thread_cpu_s", "RankBusy",
           "busy_between", "cores_note"]


def usable_cores() -> List[int]:
    """The CPU cores this process may run on (its affinity mask, which ``taskset``, cgroups
    and containers narrow), sorted; ``os.cpu_count()`` cores where the mask is unknown."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def core_for(local_rank: int, cores: Optional[Sequence[int]] = None) -> int:
    """The core a rank is pinned to: the ``local_rank``-th usable core, round robin."""
    cores = list(usable_cores() if cores is None else cores)
    if not cores:
        raise ValueError("no usable core to pin to")
    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    return cores[local_rank % len(cores)]


def pin_process(pid: int, core: int) -> bool:
    """Pin every thread of process ``pid`` to ``core`` (threads it starts later inherit the
    mask of the thread that starts them). True if every thread was pinned, False where the
    system cannot pin (not Linux) or a thread refused; a thread that ended meanwhile is skipped.
    """
    if not hasattr(os, "sched_setaffinity"):
        return False
    try:
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        threads = [pid]
    ok = True
    for tid in threads:
        try:
            os.sched_setaffinity(tid, {core})
        except ProcessLookupError:      # the thread ended
            continue
        except OSError:
            ok = False
    return ok


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def main_thread_cpu_s(pid: int) -> float:
    """Seconds of CPU time the main thread of process ``pid`` has used so far (user + system,
    from ``/proc/<pid>/task/<pid>/stat``, in clock ticks of 1/``SC_CLK_TCK`` s). Where there is
    no ``/proc``: the whole process's CPU time (psutil). Raises ``ProcessLookupError`` when the
    process has ended."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        if os.path.isdir("/proc"):
            raise ProcessLookupError(f"process {pid} has ended") from None
        import psutil   # not Linux
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    # the command name (field 2) is in parentheses and may hold spaces: split after it
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICK     # utime, stime (fields 14 and 15)


@dataclasses.dataclass
class RankBusy:
    """One rank's window from its own clock: ``wall_s`` seconds, ``busy_s`` of them with its
    main thread on a core; ``idle_s`` the rest (waiting for a peer, or for a core where ranks
    share one)."""
    rank: int
    wall_s: float
    busy_s: float

    @property
    def idle_s(self) -> float:
        return max(0.0, self.wall_s - self.busy_s)

    @property
    def busy_share(self) -> float:
        return self.busy_s / self.wall_s if self.wall_s > 0 else float("nan")


def _at(times: Sequence[float], values: Sequence[float], t: float) -> float:
    """The cumulative clock ``values`` at time ``t``, linear between samples, held at the ends."""
    i = bisect_left(times, t)
    if i == 0:
        return values[0]
    if i == len(times):
        return values[-1]
    t0, t1, v0, v1 = times[i - 1], times[i], values[i - 1], values[i]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1


def busy_between(rank: int, times: Sequence[float], cpu_s: Sequence[float], start: float,
                 end: float) -> RankBusy:
    """A rank's busy and idle seconds between ``start`` and ``end`` from samples of its
    cumulative CPU clock ``cpu_s`` taken at ``times`` (both increasing; NaN where the rank was
    not yet found is skipped). The clock at each end is interpolated between the samples
    around it."""
    pairs = [(t, c) for t, c in zip(times, cpu_s) if c == c]    # drop NaN
    if len(pairs) < 2:
        raise ValueError(f"rank {rank}: {len(pairs)} clock samples; need at least 2")
    if not end > start:
        raise ValueError(f"the window must end after it starts: start={start}, end={end}")
    ts, cs = [p[0] for p in pairs], [p[1] for p in pairs]
    if start < ts[0] or end > ts[-1]:
        raise ValueError(f"rank {rank}: the window [{start:.3f}, {end:.3f}] reaches beyond the "
                         f"samples [{ts[0]:.3f}, {ts[-1]:.3f}]: sample for longer")
    return RankBusy(rank, end - start, _at(ts, cs, end) - _at(ts, cs, start))


def cores_note(nproc: int, cores: Optional[int] = None) -> Optional[str]:
    """What a timing lesson at ``nproc`` ranks on ``cores`` cores (default: this machine's
    usable ones) cannot show, or None when every rank gets a core of its own."""
    cores = len(usable_cores()) if cores is None else cores
    if nproc <= cores:
        return None
    return (f"this machine has {cores} usable CPU core{'s' if cores != 1 else ''} for {nproc} "
            f"ranks: ranks share cores, and a rank that waits lends its core to another, so a "
            f"pipeline bubble or an exposed collective costs little wall time here. The timings "
            f"understate what a device per rank shows; run at most {cores} ranks to see it.")
