"""What each rank's device actually did: compute, communication and idle time from its trace.

``train_gpt.py --breakdown-profile DIR`` runs the timed steps under ``torch.profiler`` and
writes each rank's Chrome trace (:class:`mpu_lab.perf.breakdown.StepTimer`). This module
reads those traces and books every instant of the step window under one of three classes:

* **compute** — the device ran something that is not communication. On a GPU: the CUDA
  kernels (``cat`` ``"kernel"``) whose name has no ``nccl``, and the memory copies and sets
  (``gpu_memcpy`` / ``gpu_memset``: the device is busy, if not with matmuls). On a CPU run
  (gloo): the rank's CPU ops (``cpu_op`` and ``user_annotation`` events: the ``aten::`` ops of
  the forward, backward and optimizer step).
* **communication** — an NCCL kernel on a GPU (``ncclKernel_…``, ``ncclDevKernel_…``); on a CPU
  run the c10d / gloo ops (``c10d::send``, ``c10d::recv_``, ``c10d::allreduce_``,
  ``gloo:recv``, ``gloo:all_reduce``, …, the ``gloo:*`` spans lasting from the call until the
  work completes, on the main thread or on gloo's own threads). A collective's time is the
  transfer *plus* the wait for its slowest peer: an NCCL receive kernel spinning until the
  previous pipeline stage sends counts here, which is why this view shows a pipeline bubble
  that NVML's "utilisation" (any kernel running = busy) cannot.
* **idle** — the rest of the window: no kernel on any stream (GPU), no op open on any thread
  (CPU: Python between ops, the launcher's logging).

Where two things overlap the device did the better one: compute over communication (an
all-reduce hidden behind a matmul on another stream is not exposed), communication over idle.
On one CPU thread, ops nest: the innermost open op (the one that started last) decides, so the
wait inside a communication op called from a backward function counts as communication.

The time base is the trace's (microseconds; ranks on one host share it, and Kineto puts CUDA
kernels on the same clock as the CPU ops). ``ts + baseTimeNanoseconds / 1000`` is Unix time in
µs, which is how the step windows :class:`~mpu_lab.perf.breakdown.StepTimer` reports in
wall-clock seconds are placed on it. Results come in rank order (the trace's ``distributedInfo.rank``)::

    tls = kernel_timelines(job.results)          # train_gpt.py ... --breakdown-profile DIR
    print(format_kernel_summary(tls))            # busy / comm / idle % per rank
    viz.plot_kernel_timeline(tls)                # one row per rank, 5 ms bins
"""
from __future__ import annotations

import dataclasses
import heapq
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple, Union

__all__ = ["KernelTimeline", "load_trace", "trace_device", "is_communication",
           "classify_trace", "kernel_timeline", "kernel_timelines", "format_kernel_summary"]

Interval = Tuple[float, float]
COMPUTE, COMM, IDLE = "compute", "communication", "idle"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset")
CPU_CATEGORIES = ("cpu_op", "user_annotation")
# Communication on a CPU run: c10d's dispatcher ops, gloo's work spans, the profiler's
# collective records; then, for ops of no namespace, the collectives' own names.
_COMM_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms")
_COMM_WORDS = ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
               "reducescatter", "all_to_all", "alltoall", "broadcast", "send", "recv", "barrier")
# Spans that enclose a whole step rather than doing something.
ENCLOSING_PREFIXES = ("ProfilerStep", "PyTorch Profiler")


def load_trace(path: str) -> dict:
    """The JSON of one ``torch.profiler`` Chrome trace (``export_chrome_trace``)."""
    with open(path) as f:
        return json.load(f)


def trace_device(trace: dict) -> str:
    """``"cuda"`` when the trace holds device activity (kernels, copies), else ``"cpu"``."""
    for e in trace.get("traceEvents", ()):
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() in GPU_CATEGORIES:
            return "cuda"
    return "cpu"


def is_communication(name: str, device: str = "cpu") -> bool:
    """Whether an event of this name is communication: on ``"cuda"`` an NCCL kernel (``nccl``
    in its name); on ``"cpu"`` a c10d / gloo op (``aten::`` ops never are:
    ``aten::broadcast_tensors`` is a view)."""
    low = name.lower()
    if device == "cuda":
        return "nccl" in low
    if low.startswith("aten::"):
        return False
    return low.startswith(_COMM_PREFIXES) or any(w in low for w in _COMM_WORDS)


def _union(intervals: Sequence[Interval]) -> List[Interval]:
    out: List[Interval] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _subtract(a: Sequence[Interval], b: Sequence[Interval]) -> List[Interval]:
    """``a`` minus ``b``; both sorted and disjoint."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cur = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def _clip(intervals: Sequence[Interval], lo: float, hi: float) -> List[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _innermost(spans: Sequence[Tuple[float, float, bool]]) -> Tuple[List[Interval], List[Interval]]:
    """Compute and communication intervals of one thread or stream: at each instant the open
    span that started last (the innermost of nested ops) decides. ``spans``: (start, end,
    is_comm)."""
    spans = sorted(s for s in spans if s[1] > s[0])
    points = sorted({p for s in spans for p in s[:2]})
    heap: List[Tuple[float, float, bool]] = []     # (-start, end, is_comm): latest start on top
    compute: List[Interval] = []
    comm: List[Interval] = []
    i = 0
    for t, nxt in zip(points, points[1:]):
        while i < len(spans) and spans[i][0] <= t:
            heapq.heappush(heap, (-spans[i][0], spans[i][1], spans[i][2]))
            i += 1
        while heap and heap[0][1] <= t:
            heapq.heappop(heap)
        if heap:
            (comm if heap[0][2] else compute).append((t, nxt))
    return _union(compute), _union(comm)


def classify_trace(trace: dict) -> Tuple[str, List[Interval], List[Interval], int]:
    """``(device, compute, communication, comm_events)`` of one rank's trace: the disjoint,
    sorted intervals (µs, the trace's clock) of each class, communication already without
    the time compute overlapped, and how many communication events the trace holds."""
    device = trace_device(trace)
    cats = GPU_CATEGORIES if device == "cuda" else CPU_CATEGORIES
    lanes: Dict[Tuple, List[Tuple[float, float, bool]]] = {}
    count = 0
    for e in trace.get("traceEvents", ()):
        if e.get("ph") != "X" or str(e.get("cat", "")).lower() not in cats:
            continue
        name = str(e.get("name", ""))
        if name.startswith(ENCLOSING_PREFIXES):
            continue
        comm = is_communication(name, device)
        count += comm
        start = float(e["ts"])
        lanes.setdefault((e.get("pid"), e.get("tid")), []).append(
            (start, start + float(e.get("dur", 0.0)), comm))
    compute: List[Interval] = []
    comm_iv: List[Interval] = []
    for spans in lanes.values():     # a CPU thread, or a GPU stream
        c, m = _innermost(spans)
        compute += c
        comm_iv += m
    compute = _union(compute)
    return device, compute, _subtract(_union(comm_iv), compute), count


@dataclasses.dataclass
class KernelTimeline:
    """One rank's classified time: ``compute[i]``, ``comm[i]``, ``idle[i]`` are the µs of
    each class in bin ``i`` (``bin_us`` wide; the last bin may be shorter) of ``window``
    (start, end; µs on the trace's clock). ``device``: ``"cuda"`` or ``"cpu"``;
    ``comm_events``: how many communication events the whole trace holds."""
    rank: int
    device: str
    window: Interval
    bin_us: float
    compute: List[float]
    comm: List[float]
    idle: List[float]
    comm_events: int = 0

    @property
    def window_s(self) -> float:
        return (self.window[1] - self.window[0]) / 1e6

    def bin_starts_ms(self) -> List[float]:
        """Each bin's start, ms from the window's start."""
        return [i * self.bin_us / 1e3 for i in range(len(self.compute))]

    def summary(self) -> Dict[str, float]:
        """Seconds and percent of the window in each class: ``busy_pct`` (compute),
        ``comm_pct``, ``idle_pct`` (they sum to 100), ``compute_s``, ``comm_s``, ``idle_s``."""
        total = self.window[1] - self.window[0]
        parts = dict(compute=sum(self.compute), comm=sum(self.comm), idle=sum(self.idle))
        pct = (lambda v: 100.0 * v / total) if total > 0 else (lambda v: float("nan"))
        return dict(rank=self.rank, window_s=total / 1e6, busy_pct=pct(parts["compute"]),
                    comm_pct=pct(parts["comm"]), idle_pct=pct(parts["idle"]),
                    compute_s=parts["compute"] / 1e6, comm_s=parts["comm"] / 1e6,
                    idle_s=parts["idle"] / 1e6, comm_events=self.comm_events)


def _binned(intervals: Sequence[Interval], lo: float, n: int, width: float) -> List[float]:
    out = [0.0] * n
    for a, b in intervals:
        i = int((a - lo) // width)
        while a < b and i < n:
            edge = lo + (i + 1) * width
            out[i] += min(b, edge) - a
            a, i = edge, i + 1
    return out


def kernel_timeline(trace: Union[str, dict], window: Optional[Interval] = None,
                    bin_ms: float = 5.0, rank: Optional[int] = None) -> KernelTimeline:
    """Classify one rank's trace (a path or the loaded JSON) over ``window`` (µs, the trace's
    clock; default: from its first classified event to its last) in bins of ``bin_ms``.
    ``rank``: default the trace's ``distributedInfo.rank`` (0 if absent)."""
    if not bin_ms > 0:
        raise ValueError(f"bin_ms must be > 0, got {bin_ms}")
    trace = load_trace(trace) if isinstance(trace, str) else trace
    device, compute, comm, count = classify_trace(trace)
    if window is None:
        spans = compute + comm
        if not spans:
            raise ValueError("the trace holds no kernel or op to classify")
        window = (min(a for a, _ in spans), max(b for _, b in spans))
    lo, hi = float(window[0]), float(window[1])
    if not hi > lo:
        raise ValueError(f"empty window {window}")
    width = bin_ms * 1e3
    n = max(1, int(-(-(hi - lo) // width)))
    c = _binned(_clip(compute, lo, hi), lo, n, width)
    m = _binned(_clip(comm, lo, hi), lo, n, width)
    sizes = [min(width, hi - (lo + i * width)) for i in range(n)]
    idle = [max(0.0, s - x - y) for s, x, y in zip(sizes, c, m)]
    if rank is None:
        rank = int(trace.get("distributedInfo", {}).get("rank", 0))
    return KernelTimeline(rank, device, (lo, hi), width, c, m, idle, count)


def _base_us(trace: dict) -> float:
    """Unix time (µs) of the trace's zero: ``ts + _base_us`` is a wall-clock instant."""
    return float(trace.get("baseTimeNanoseconds", 0)) / 1e3


def _sources(source) -> List[Tuple[dict, Optional[Interval]]]:
    """(trace, wall-clock window in s or None) for each rank of ``source``."""
    if isinstance(source, str):      # a --breakdown-profile directory
        names = sorted((n for n in os.listdir(source) if n.endswith(".trace.json")),
                       key=lambda n: int("".join(ch for ch in n if ch.isdigit()) or 0))
        return [(load_trace(os.path.join(source, n)), None) for n in names]
    out = []
    for item in source:
        if isinstance(item, dict) and ("breakdown" in item or "window" in item):
            b = item.get("breakdown", item)       # a rank's train_gpt.py result, or its breakdown
            if "profile" not in b:
                raise ValueError("no trace in this result: run train_gpt.py with "
                                 "--breakdown-profile DIR")
            window = tuple(b["window"]) if None not in b.get("window", [None]) else None
            out.append((load_trace(b["profile"]["trace"]), window))
        elif isinstance(item, dict):                            # a loaded trace
            out.append((item, None))
        else:                                                   # a path
            out.append((load_trace(str(item)), None))
    return out


def kernel_timelines(source, bin_ms: float = 5.0) -> List[KernelTimeline]:
    """Every rank's :class:`KernelTimeline`, in rank order, over one common window so the rows
    line up. ``source``: a ``train_gpt.py --breakdown-profile`` job's ``results`` or their
    breakdowns (:func:`mpu_lab.perf.breakdown.breakdowns`, a ``ProfiledRun``'s ``reports``;
    the window is then the ranks' timed steps, :func:`~mpu_lab.perf.breakdown.training_window`), a
    directory of ``rank<r>.trace.json``, or a list of trace paths or loaded traces (the
    window: from the first classified event of any rank to the last)."""
    items = _sources(source)
    if not items:
        raise ValueError(f"no traces in {source!r}")
    walls = [w for _, w in items if w is not None]
    if len(walls) == len(items):                 # the timed steps, on each trace's clock
        start, end = min(w[0] for w in walls), max(w[1] for w in walls)
        windows = [(start * 1e6 - _base_us(t), end * 1e6 - _base_us(t)) for t, _ in items]
    else:
        spans = []
        for t, _ in items:
            _, c, m, _ = classify_trace(t)
            spans += c + m
        if not spans:
            raise ValueError("the traces hold no kernel or op to classify")
        common = (min(a for a, _ in spans), max(b for _, b in spans))
        windows = [common] * len(items)
    out = [kernel_timeline(t, w, bin_ms, rank=int(t.get("distributedInfo", {}).get("rank", i)))
           for i, ((t, _), w) in enumerate(zip(items, windows))]
    return sorted(out, key=lambda tl: tl.rank)


def format_kernel_summary(timelines: Sequence[KernelTimeline]) -> str:
    """One line per rank: window, busy (compute), communication and idle percent."""
    head = (f"{'rank':>4} {'device':>6} {'window ms':>10} {'busy %':>7} {'comm %':>7} "
            f"{'idle %':>7} {'comm events':>12}")
    lines = [head]
    for tl in timelines:
        s = tl.summary()
        lines.append(f"{tl.rank:>4} {tl.device:>6} {s['window_s'] * 1e3:10.1f} "
                     f"{s['busy_pct']:7.1f} {s['comm_pct']:7.1f} {s['idle_pct']:7.1f} "
                     f"{tl.comm_events:>12}")
    return "\n".join(lines)
