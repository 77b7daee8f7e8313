"""Time a training step and the collectives inside it, on one rank (``--breakdown``).

Megatron's ``core/timers.py`` role, kept small and outside the mirror: :class:`StepTimer` times
whole steps and, through :class:`mpu_lab.perf.comm_timing.CommTimer`, every collective and p2p
call inside them; :func:`categorize` books each call under its group family (``tp all_reduce``,
``dp all_reduce``, ``pp p2p``, ...). :func:`timing_train_steps` installs a timer around
``mpu_lab.training``'s ``train_step`` from outside (``launch/train_gpt.py --breakdown``); the
lab kit and :mod:`mpu_lab.perf` read the reports.

What "waiting" means: every collective is synchronous, so a rank's time inside one is the
transfer *plus* the wait for the slowest member of its group (for p2p, the neighbouring
stage: the pipeline bubble). ``barrier=True`` puts a barrier before each call and books it as
``wait``, which separates the two.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state as ps
from mpu_lab.perf.comm_timing import CommTimer
from mpu_lab.training import training

COMPUTE = "compute"
WAIT = "wait (barrier)"
OTHER = "other"
# Drawing order (and the order of the printed columns); absent categories are left out.
CATEGORY_ORDER = (COMPUTE, "tp all_reduce", "tp all_gather", "tp reduce_scatter", "tp broadcast",
                  "dp all_reduce", "pp p2p", OTHER, WAIT)


def categorize(kind: str, ranks: Sequence[int], numel: int,
               families: Dict[str, Optional[Sequence[int]]]) -> str:
    """The breakdown category of one timed call: ``"pp p2p"`` for pipeline messages;
    ``"other"`` for bookkeeping, i.e. a single number (the loss for the log line, the gradient
    norm, the fp16 overflow vote), and for groups of no family (the tied embedding's first and
    last stage); else ``"<family> <kind>"`` with the family (``tp`` or ``dp``; in that order,
    since groups with the same ranks are one group) whose ranks equal the call's group."""
    if kind == "p2p":
        return "pp p2p"
    if numel <= 1:
        return OTHER
    ranks = tuple(ranks)
    for family in ("tp", "dp"):
        members = families.get(family)
        if members is not None and len(members) > 1 and tuple(members) == ranks:
            return f"{family} {kind}"
    return OTHER


class StepTimer:
    """Times whole training steps and the collectives inside them, on one rank.

    ``time_step(fn, *args)`` runs one step under a
    :class:`~mpu_lab.perf.comm_timing.CommTimer`; the first ``skip`` steps run untimed
    (first-call allocations and warm-up). On CUDA the device is
    synchronised before and after each step. :meth:`report` gives the per-step means, JSON-able.
    With ``profile_dir`` the timed steps also run under ``torch.profiler`` (CPU, and CUDA on a
    GPU): :meth:`report` writes this rank's Chrome trace (``rank<r>.trace.json``, for
    chrome://tracing or Perfetto) and adds the ops that took the most time. The profiler slows
    every op down a little; the breakdown is then that of the profiled run.
    """

    def __init__(self, device=None, barrier: bool = False, skip: int = 1,
                 profile_dir: Optional[str] = None):
        if skip < 0:
            raise ValueError(f"skip must be >= 0 steps, got {skip}")
        self.device = device
        self.barrier = barrier
        self.skip = skip
        self.comm_timer = CommTimer(barrier=barrier)
        self.step_seconds: List[float] = []
        self.window: List[Optional[float]] = [None, None]   # time.time() of first start, last end
        self._seen = 0
        self.profile_dir = profile_dir
        self._profiler = None

    def _sync(self):
        if self.device is not None:
            initialize.synchronize(self.device)

    def time_step(self, fn: Callable, *args, **kwargs):
        self._seen += 1
        if self._seen <= self.skip:
            return fn(*args, **kwargs)
        if self.profile_dir and self._profiler is None:
            self._profiler = self._start_profiler()
        self._sync()
        wall, start = time.time(), time.perf_counter()
        with self.comm_timer:
            out = fn(*args, **kwargs)
        self._sync()
        self.step_seconds.append(time.perf_counter() - start)
        if self.window[0] is None:
            self.window[0] = wall
        self.window[1] = time.time()
        return out

    def _start_profiler(self):
        activities = [ProfilerActivity.CPU]
        if getattr(self.device, "type", "cpu") == "cuda":
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities)
        prof.start()
        return prof

    def _finish_profile(self, rank: int, steps: int, top: int = 12) -> Dict[str, Any]:
        """Stop the profiler, write the trace, return the top ops by self time per step."""
        prof, self._profiler = self._profiler, None
        prof.stop()
        os.makedirs(self.profile_dir, exist_ok=True)
        path = os.path.join(self.profile_dir, f"rank{rank}.trace.json")
        prof.export_chrome_trace(path)
        on_gpu = getattr(self.device, "type", "cpu") == "cuda"

        def self_us(event):   # microseconds (self_device_time_total: torch >= 2.4, our floor 2.11)
            return event.self_device_time_total if on_gpu else event.self_cpu_time_total
        events = sorted(prof.key_averages(), key=self_us, reverse=True)[:top]
        return dict(trace=path, clock="device" if on_gpu else "cpu",
                    top_ops=[dict(name=e.key, self_ms=self_us(e) / 1e3 / max(steps, 1),
                                  calls=e.count / max(steps, 1)) for e in events])

    def report(self) -> Dict[str, Any]:
        """This rank's breakdown: ``parts`` (seconds per step by category, ``compute`` being
        the step minus all communication), ``calls`` and ``bytes`` per step, ``step_s`` (mean
        step), ``steps`` (how many were timed), its coordinates and the timed ``window``; with
        a profile, ``profile`` (the trace's path and the top ops per step)."""
        n = len(self.step_seconds)
        families = {f: ps.get_group_ranks(f) for f in ("tp", "dp", "pp")}
        seconds: Dict[str, float] = {}
        calls: Dict[str, float] = {}
        nbytes: Dict[str, float] = {}
        wait = 0.0
        for call in self.comm_timer.calls:
            cat = categorize(call.kind, call.ranks, call.numel, families)
            seconds[cat] = seconds.get(cat, 0.0) + call.seconds
            calls[cat] = calls.get(cat, 0) + 1
            nbytes[cat] = nbytes.get(cat, 0) + call.nbytes
            wait += call.barrier_s
        total = sum(self.step_seconds)
        parts = {COMPUTE: total - sum(seconds.values()) - wait, **seconds}
        if self.barrier:
            parts[WAIT] = wait
        per_step = (lambda d: {k: v / n for k, v in d.items()}) if n else (lambda d: {})
        extra = {}
        if self._profiler is not None:
            extra["profile"] = self._finish_profile(dist.get_rank(), n)
        return dict(**extra,
            rank=dist.get_rank(), steps=n, step_s=total / n if n else float("nan"),
            step_seconds=list(self.step_seconds), parts=per_step(parts), calls=per_step(calls),
            bytes=per_step(nbytes), barrier=self.barrier, window=list(self.window),
            device=str(self.device) if self.device is not None else "cpu",
            tp=ps.get_tensor_model_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            dp=ps.get_data_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank())


def step_timer_for(args) -> Optional[StepTimer]:
    """The timer ``train_gpt.py``'s ``--breakdown``, ``--breakdown-barrier`` or
    ``--breakdown-profile DIR`` asks for (``None`` without them); the first step is not timed."""
    barrier, profile_dir = getattr(args, "breakdown_barrier", False), \
        getattr(args, "breakdown_profile", None)
    if not (getattr(args, "breakdown", False) or barrier or profile_dir):
        return None
    return StepTimer(initialize.get_device(), barrier=barrier, profile_dir=profile_dir)


@contextlib.contextmanager
def timing_train_steps(timer: StepTimer):
    """Inside the block, every ``train_step`` that ``mpu_lab.training``'s loop runs goes
    through ``timer.time_step``: the timer is installed from outside, the loop is unchanged."""
    original = training.train_step

    def timed_train_step(state, *args, **kwargs):
        return timer.time_step(original, state, *args, **kwargs)

    training.train_step = timed_train_step
    try:
        yield timer
    finally:
        training.train_step = original
