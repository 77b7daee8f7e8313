"""How busy each rank is over time: samples of a ``torchrun`` job, and the ideal picture.

* :class:`UtilisationSampler` — for every ``torchrun`` worker (found in the launcher's process
  tree) whether it is running or runnable, its CPU use (psutil), or its main thread's own CPU
  clock (``"clock"``: busy and idle seconds per rank, :mod:`mpu_lab.perf.rank_clock`), each
  worker optionally pinned to a core of its own; GPU utilisation through NVML where there is
  a GPU; :func:`run_with_utilisation` wraps :func:`mpu_lab.launcher.run` in
  one. :func:`mpu_lab.labkit.performance.viz.plot_utilisation` draws the result as one row per rank.
* :func:`schedule_utilisation` — what a perfect machine would show for a pipeline schedule
  (the 1F1B and GPipe schedules of Narayanan et al. 2021 §2.2, simulated by
  :mod:`mpu_lab.perf.pipeline_simulation`).

What NVML's GPU utilisation is, and why it cannot show a pipeline bubble: it is "the percent
of time over the past sample period during which one or more kernels was executing on the
GPU" (``nvmlDeviceGetUtilizationRates``), where the driver's sample period is between 1/6 s
and 1 s depending on the product — so a 50 ms sampler mostly re-reads the same value, and
nothing shorter than the driver's window is resolved. And *any* kernel counts: an NCCL
receive kernel spinning while it waits for the previous pipeline stage keeps the GPU at
100 %, as does a kernel that uses one SM of 132. Read it as "what nvidia-smi says". What the
device actually did — compute kernels, NCCL kernels, nothing — comes from the profiler's
trace: :mod:`mpu_lab.perf.kernel_timeline`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mpu_lab import launcher
from mpu_lab.launcher import descendants, rank_client, rank_server
from mpu_lab.perf.rank_clock import (RankBusy, busy_between, core_for, main_thread_cpu_s,
                                     pin_process, usable_cores)
from mpu_lab.perf.pipeline_simulation import simulate

__all__ = ["Utilisation", "schedule_utilisation", "UtilisationSampler", "run_with_utilisation"]


@dataclasses.dataclass
class Utilisation:
    """Samples of how busy each rank was: ``values[rank][i]`` at ``times[i]`` (``time.time()``),
    NaN where the rank's process did not exist (yet). ``kind`` is ``"cpu"`` (percent of one
    core, psutil; above 100 when a rank runs several threads), ``"runnable"`` (100 when the
    rank's main thread was running or waiting for a core at the sample, 0 when it was blocked,
    e.g. in a collective: what the rank *wanted* to do, whatever other processes took) or
    ``"clock"`` (the share of the time since the previous sample that the rank's main thread
    spent on a core, from its own CPU clock: 100 computing, 0 waiting), ``"gpu"`` (NVML's
    percent of time a kernel ran on the rank's GPU); ``"schedule"`` for the ideal pictures of
    :func:`schedule_utilisation`. ``machine[i]``: the whole machine's CPU use, percent of all
    its ``cores`` (every process, not only the job's: it shows contention).

    Under ``"clock"`` sampling, ``cpu_seconds[rank]`` is the rank's cumulative main-thread CPU
    time at ``clock_times`` (kept one sample beyond each end of a :meth:`crop`, so that
    :meth:`busy` interpolates the clock at the window's edges); ``pinned[rank]`` the core a
    rank was pinned to.
    """
    kind: str
    interval_s: float
    times: List[float]
    values: Dict[int, List[float]]
    cores: int
    machine: List[float] = dataclasses.field(default_factory=list)
    clock_times: List[float] = dataclasses.field(default_factory=list)
    cpu_seconds: Dict[int, List[float]] = dataclasses.field(default_factory=dict)
    pinned: Dict[int, int] = dataclasses.field(default_factory=dict)
    window: Optional[Tuple[float, float]] = None

    def crop(self, start: float, end: float) -> "Utilisation":
        """The samples between ``start`` and ``end`` (e.g. :func:`training_window`)."""
        keep = [i for i, t in enumerate(self.times) if start <= t <= end]
        ct = self.clock_times      # the clock samples from the last at or before start ...
        lo = max([i for i, t in enumerate(ct) if t <= start], default=0)
        hi = min([i for i, t in enumerate(ct) if t >= end], default=len(ct) - 1)
        around = range(lo, hi + 1)  # ... to the first at or after end
        return Utilisation(self.kind, self.interval_s, [self.times[i] for i in keep],
                           {r: [v[i] for i in keep] for r, v in self.values.items()}, self.cores,
                           [self.machine[i] for i in keep] if self.machine else [],
                           [self.clock_times[i] for i in around],
                           {r: [v[i] for i in around] for r, v in self.cpu_seconds.items()},
                           dict(self.pinned), (start, end))

    def busy(self) -> List[RankBusy]:
        """Each rank's busy and idle seconds over the window of the last :meth:`crop` (the
        whole sampling otherwise), from its own CPU clock (``"clock"`` sampling only)."""
        if not self.cpu_seconds:
            raise ValueError(f"busy() needs the ranks' own clocks: sample with "
                             f"cpu_metric='clock' (this is {self.kind!r})")
        start, end = self.window or (self.clock_times[0], self.clock_times[-1])
        return [busy_between(r, self.clock_times, c, start, end)
                for r, c in sorted(self.cpu_seconds.items())]

    def mean(self) -> Dict[int, float]:
        """Per rank, the mean over its valid samples."""
        out = {}
        for r, v in sorted(self.values.items()):
            good = [x for x in v if not math.isnan(x)]
            out[r] = sum(good) / len(good) if good else float("nan")
        return out

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def schedule_utilisation(schedule: str, p: int, m: int, v: int = 1, iterations: int = 3,
                         samples_per_slot: int = 4) -> Utilisation:
    """The utilisation picture a perfect machine would show: each pipeline rank 100 % busy
    inside its forward and backward passes and 0 % between them, for ``iterations``
    back-to-back runs of the logical schedule of lab 11
    (:func:`mpu_lab.perf.pipeline_simulation.simulate`; a forward takes one time slot).
    ``times`` are in slots, sampled ``samples_per_slot`` times per slot (mid-points)."""
    timeline = simulate(schedule, p, m, v)
    length = max(float(r[4]) for rank in timeline.records for r in rank)
    n = int(round(length * samples_per_slot)) * iterations
    times = [(i + 0.5) / samples_per_slot for i in range(n)]
    values = {}
    for rank, records in enumerate(timeline.records):
        spans = [(float(r[3]), float(r[4])) for r in records]
        values[rank] = [100.0 if any(a <= t % length < b for a, b in spans) else 0.0 for t in times]
    return Utilisation("schedule", 1.0 / samples_per_slot, times, values, cores=p)


def _worker_rank(proc) -> Tuple[Optional[int], Dict[str, str]]:
    """The global rank of a torchrun worker (from the variables torchrun sets for workers
    only: ``ROLE_RANK`` is not inherited from a notebook), None for anything else; and the
    worker's environment."""
    try:
        env = proc.environ()
    except Exception:   # gone, or not ours
        return None, {}
    if "ROLE_RANK" not in env or "RANK" not in env:
        return None, env
    return int(env["RANK"]), env


class UtilisationSampler:
    """Sample, on a background thread of *this* process, how busy the ranks of the
    ``torchrun`` jobs started from it are:

        with UtilisationSampler(interval_s=0.05) as sampler:
            job = launcher.run("train_gpt.py", flags, nproc=4)
        util = sampler.result()

    CPU: every ``interval_s`` the worker processes are found among this process's descendants
    (:func:`mpu_lab.launcher.descendants`; a worker is a process with torchrun's ``ROLE_RANK``)
    and psutil reads, per ``cpu_metric``, their CPU use since the last sample (``"cpu"``) or
    whether their main thread is running or runnable now (``"runnable"``). GPU (``gpu=True``, or
    ``"auto"``: where NVML finds one): NVML's utilisation of each rank's GPU, ``LOCAL_RANK``
    modulo the GPU count as :func:`mpu_lab.training.initialize.choose_device` assigns them (NVML
    numbers GPUs by PCI bus; set ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA agrees).

    ``cpu_metric="clock"`` reads each worker's main-thread CPU clock instead
    (:func:`mpu_lab.perf.rank_clock.main_thread_cpu_s`); ``pin=True`` pins each worker, as
    soon as it is found, to the usable core of its ``LOCAL_RANK`` (round robin,
    :func:`mpu_lab.perf.rank_clock.core_for`). Under NVML sampling ``pin`` does nothing.
    """

    def __init__(self, interval_s: float = 0.05, gpu="auto", root_pid: Optional[int] = None,
                 cpu_metric: str = "cpu", pin: bool = False):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if gpu not in ("auto", True, False):
            raise ValueError(f"gpu must be 'auto', True or False, got {gpu!r}")
        if cpu_metric not in ("cpu", "runnable", "clock"):
            raise ValueError(f"cpu_metric must be 'cpu', 'runnable' or 'clock', got "
                             f"{cpu_metric!r}")
        self.interval_s = interval_s
        self.root_pid = os.getpid() if root_pid is None else root_pid
        self._gpu_handles = self._open_nvml() if gpu else []
        if gpu is True and not self._gpu_handles:
            raise ValueError("gpu=True but NVML finds no GPU here; use gpu='auto' or False")
        self.kind = "gpu" if self._gpu_handles else cpu_metric
        self.times: List[float] = []
        self.values: Dict[int, List[float]] = {}
        self.machine: List[float] = []
        self.clock_times: List[float] = []
        self.cpu_seconds: Dict[int, List[float]] = {}
        self.pin = bool(pin) and not self._gpu_handles
        self._cores = usable_cores()
        self.pinned: Dict[int, int] = {}
        self._procs: Dict[int, Any] = {}         # pid -> psutil.Process of a worker
        self._rank_of: Dict[int, int] = {}       # pid -> rank
        self._local_rank: Dict[int, int] = {}    # rank -> local rank
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @staticmethod
    def _open_nvml() -> list:
        try:
            import pynvml   # nvidia-ml-py
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception:   # no library, no driver or no GPU: CPU sampling
            return []

    def _refresh(self):
        import psutil      # optional dependency, only where a job is sampled
        for pid in descendants(self.root_pid):
            if pid in self._rank_of or pid in self._procs:
                continue
            try:
                proc = psutil.Process(pid)
            except psutil.Error:
                continue
            rank, env = _worker_rank(proc)
            if rank is not None and rank_client.SERVER_ENV in env:
                # torchrun's worker is a rank client: the rank is the process it stands for
                forked = rank_server.forked_rank(pid, env)
                if forked is None:           # not forked yet: look again
                    continue
                self._rank_of[pid] = -1
                pid = forked
                try:
                    proc = psutil.Process(pid)
                except psutil.Error:
                    continue
            if rank is None:
                # Not a worker. A process forked a moment ago may still carry its parent's
                # environment (before exec): look again later unless it has settled.
                try:
                    settled = time.time() - proc.create_time() > 2.0
                except psutil.Error:
                    settled = True
                if settled:
                    self._rank_of[pid] = -1
                continue
            try:
                parent = proc.ppid()
            except psutil.Error:
                continue
            if self._rank_of.get(parent, -1) == rank:   # a child of the worker (same RANK)
                self._rank_of[pid] = -1
                continue
            self._rank_of[pid] = rank
            self._procs[pid] = proc
            self._local_rank[rank] = int(env.get("LOCAL_RANK", rank))
            try:
                proc.cpu_percent(None)           # the first call only starts the clock
            except psutil.Error:
                pass
            if self.pin:
                core = core_for(self._local_rank.get(rank, rank), self._cores)
                if pin_process(pid, core):
                    self.pinned[rank] = core

    def _sample(self):
        import psutil
        now = time.time()
        row: Dict[int, float] = {}
        if self._gpu_handles:
            import pynvml
            util = [pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._gpu_handles]
            for rank, local in self._local_rank.items():
                row[rank] = float(util[local % len(util)])
        elif self.kind == "clock":
            clock: Dict[int, float] = {}
            for pid in list(self._procs):
                try:
                    clock[self._rank_of[pid]] = main_thread_cpu_s(pid)
                except (ProcessLookupError, OSError):
                    del self._procs[pid]
            for rank, seconds in clock.items():
                series = self.cpu_seconds.get(rank)
                if series and self.clock_times and series[-1] == series[-1]:
                    dt = now - self.clock_times[-1]
                    row[rank] = 100.0 * (seconds - series[-1]) / dt if dt > 0 else math.nan
                else:
                    row[rank] = math.nan
            self.clock_times.append(now)
            for rank in set(clock) | set(self.cpu_seconds):
                column = self.cpu_seconds.setdefault(rank,
                                                     [math.nan] * (len(self.clock_times) - 1))
                column.append(clock.get(rank, math.nan))
        else:
            for pid, proc in list(self._procs.items()):
                try:
                    if self.kind == "runnable":   # the main thread's state (R: running or queued)
                        running = proc.status() == psutil.STATUS_RUNNING
                        row[self._rank_of[pid]] = 100.0 if running else 0.0
                    else:
                        row[self._rank_of[pid]] = proc.cpu_percent(None)
                except psutil.Error:
                    del self._procs[pid]
        self.times.append(now)
        self.machine.append(psutil.cpu_percent(None))
        for rank in set(row) | set(self.values):
            column = self.values.setdefault(rank, [math.nan] * (len(self.times) - 1))
            column.append(row.get(rank, math.nan))

    def _loop(self):
        tick = 0
        while not self._stop.is_set():
            if tick % 10 == 0 or not self._procs:
                self._refresh()
            self._sample()
            tick += 1
            self._stop.wait(self.interval_s)

    def __enter__(self):
        import psutil
        psutil.cpu_percent(None)                 # start the machine-wide clock
        self._thread = threading.Thread(target=self._loop, daemon=True, name="utilisation")
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return False

    def result(self) -> Utilisation:
        return Utilisation(self.kind, self.interval_s, list(self.times),
                           {r: list(v) for r, v in sorted(self.values.items())},
                           os.cpu_count() or 1, list(self.machine), list(self.clock_times),
                           {r: list(v) for r, v in sorted(self.cpu_seconds.items())},
                           dict(sorted(self.pinned.items())))


def run_with_utilisation(script, args: Sequence = (), nproc: int = 2, interval_s: float = 0.05,
                         gpu="auto", cpu_metric: str = "cpu", pin: bool = False, **run_kwargs):
    """:func:`mpu_lab.launcher.run` with a :class:`UtilisationSampler` around it; returns
    ``(job, utilisation)``."""
    with UtilisationSampler(interval_s=interval_s, gpu=gpu, cpu_metric=cpu_metric,
                            pin=pin) as sampler:
        job = launcher.run(script, args, nproc=nproc, **run_kwargs)
    return job, sampler.result()

