"""Where a training step's time goes, per rank and per kind of collective
(``train_gpt.py --breakdown``, lab 15).

On each rank a :class:`StepTimer` — a callback of the training loop
(:class:`mpu_lab.training.training.Callback`: ``train(..., callbacks=[timer])``), in the role of
Megatron's ``core/timers.py`` and kept outside the mirror — times whole steps and, through
:class:`mpu_lab.perf.comm_timing.CommTimer`, every collective and p2p call inside them;
:func:`categorize` books each call under its group family (``tp all_reduce``, ``dp all_reduce``,
``pp p2p``, ...) and the rest of the step is computation. Over the ranks, this module collects
the reports (:func:`breakdowns`), orders their categories (:func:`categories`), tabulates them
(:func:`format_breakdown`) and finds the timed window (:func:`training_window`).

What "waiting" means here: every collective and p2p call is synchronous, so the time a rank
spends inside one is the transfer *plus* the time it waits for the slowest member of its group
(or, for p2p, for the neighbouring stage to produce the activation: the pipeline bubble,
Narayanan et al. 2021 §2.2). The breakdown books both under the collective;
``--breakdown-barrier`` (``barrier=True``) puts a barrier before each collective and books it
as ``wait``, which separates the two (at the price of an extra synchronisation).
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from mpu_lab.core import parallel_state as ps
from mpu_lab.perf.comm_timing import CommTimer
from mpu_lab.training import initialize
from mpu_lab.training.training import Callback

__all__ = ["CATEGORY_ORDER", "COMPUTE", "StepTimer", "breakdowns", "categories", "categorize",
           "format_breakdown", "step_timer_for", "training_window"]

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


class StepTimer(Callback):
    """Times whole training steps and the collectives inside them, on one rank.

    A callback of the training loop: ``train(state, callbacks=[timer])`` (or
    ``train_step(state, [timer])``) times each step from its ``on_step_begin`` to its
    ``on_step_end``, under a :class:`~mpu_lab.perf.comm_timing.CommTimer`; ``time_step(fn,
    *args)`` times one call of a step function the same way. The first ``skip`` steps run
    untimed (first-call allocations and warm-up). On CUDA the device is synchronised before
    and after each step. :meth:`report` gives the per-step means, JSON-able.
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
        self._open: Optional[contextlib.ExitStack] = None     # the step being timed
        self._start = (0.0, 0.0)                               # its (time.time, perf_counter)

    def _sync(self):
        if self.device is not None:
            initialize.synchronize(self.device)

    def on_step_begin(self, state=None) -> None:
        self._seen += 1
        if self._seen <= self.skip:
            return
        if self.profile_dir and self._profiler is None:
            self._profiler = self._start_profiler()
        self._sync()
        self._start = (time.time(), time.perf_counter())
        self._open = contextlib.ExitStack()
        self._open.enter_context(self.comm_timer)

    def on_step_end(self, state=None, step=None) -> None:
        if self._open is None:          # an untimed step
            return
        self._open.close()
        self._open = None
        self._sync()
        self.step_seconds.append(time.perf_counter() - self._start[1])
        if self.window[0] is None:
            self.window[0] = self._start[0]
        self.window[1] = time.time()

    def time_step(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` (a step run without this callback) timed as one step."""
        self.on_step_begin()
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            if self._open is not None:        # close the collectives' timer; book nothing
                self._open.close()
                self._open = None
            raise
        self.on_step_end()
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


def breakdowns(results: Sequence[Optional[dict]]) -> List[dict]:
    """The ``"breakdown"`` of every rank's ``train_gpt.py --breakdown`` report, rank order."""
    out = []
    for rank, result in enumerate(results):
        if not result or "breakdown" not in result:
            raise ValueError(f"rank {rank} reported no breakdown: run train_gpt.py with "
                             f"--breakdown")
        out.append(result["breakdown"])
    return out


def categories(reports: Sequence[dict]) -> List[str]:
    """The categories present in any rank's breakdown, in :data:`CATEGORY_ORDER`."""
    present = {k for r in reports for k in r["parts"]}
    return [c for c in CATEGORY_ORDER if c in present] + sorted(present - set(CATEGORY_ORDER))


def format_breakdown(reports: Sequence[dict], unit: str = "ms") -> str:
    """One line per rank: mean step time and each category's share of it (ms and %)."""
    scale = {"ms": 1e3, "s": 1.0, "us": 1e6}[unit]
    cats = categories(reports)
    head = (f"{'rank':>4} {'(tp,pp,dp)':>10} {'step ' + unit:>9} "
            + " ".join(f"{c:>17}" for c in cats))
    lines = [head]
    for r in reports:
        coord = f"({r['tp_rank']},{r['pp_rank']},{r['dp_rank']})"
        cells = []
        for c in cats:
            v = r["parts"].get(c, 0.0)
            cells.append(f"{v * scale:8.1f} ({100 * v / r['step_s']:3.0f}%)" if r["step_s"] > 0
                         else f"{'-':>17}")
        lines.append(f"{r['rank']:>4} {coord:>10} {r['step_s'] * scale:9.1f} "
                     + " ".join(f"{c:>17}" for c in cells))
    return "\n".join(lines)


def training_window(reports: Sequence[dict]) -> Tuple[float, float]:
    """``(earliest start, latest end)`` of the timed steps over all ranks (``time.time()``)."""
    starts = [r["window"][0] for r in reports if r["window"][0] is not None]
    ends = [r["window"][1] for r in reports if r["window"][1] is not None]
    if not starts:
        raise ValueError("no rank timed a step: train more iterations than the skipped ones")
    return min(starts), max(ends)

