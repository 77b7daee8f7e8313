"""Measure a run: collective bandwidth, where a training step's time goes, how busy each rank is.

Three tools, one per question of "why is my utilisation low":

* **Bandwidth** of the collectives, as nccl-tests reports it: ``algbw`` and ``busbw``
  (:func:`algbw`, :func:`busbw`; ``launch/bench_bandwidth.py`` runs them over message sizes).
* **Step-time breakdown** (``launch/train_gpt.py --breakdown``): per rank, the seconds of an
  iteration spent in each kind of collective — tensor-parallel all-reduce / all-gather /
  reduce-scatter / broadcast, data-parallel all-reduce, pipeline p2p — and the rest, which is
  computation (:class:`StepTimer`, on top of :class:`mpu_lab.comm.CommTimer`).
* **Utilisation over time** (:class:`UtilisationSampler`): for every ``torchrun`` worker
  (found in the launcher's process tree) whether it is running or runnable, or its CPU use
  (psutil); GPU utilisation through NVML where there is a GPU;
  :func:`mpu_lab.viz.plot_utilisation` draws it as one row per rank.

What "waiting" means here: every collective and p2p call is synchronous, so the time a rank
spends inside one is the transfer *plus* the time it waits for the slowest member of its group
(or, for p2p, for the neighbouring stage to produce the activation: the pipeline bubble). The
breakdown books both under the collective; ``--breakdown-barrier`` puts a barrier before each
collective and books it as ``wait``, which separates the two (at the price of an extra
synchronisation).
"""
from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

# --------------------------------------------------------------------------- bandwidth
# NVIDIA nccl-tests, doc/PERFORMANCE.md ("Performance reported by NCCL tests"): the bus
# bandwidth is the algorithm bandwidth S/t times a factor that makes it comparable with the
# hardware's link bandwidth whatever the number of ranks n. A ring all-reduce moves every
# byte 2(n-1)/n times over each rank's link, all-gather and reduce-scatter (n-1)/n times
# (S being the *whole* gathered / scattered array), broadcast once (all data leave the root).
_BUS_FACTORS: Dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
COLLECTIVES: Tuple[str, ...] = tuple(_BUS_FACTORS)
GLOO_REDUCE_SCATTER_NOTE = (
    "on gloo, mpu_lab.comm computes reduce_scatter as an all-reduce followed by keeping this "
    "rank's chunk (gloo's own reduce_scatter is slower on shared cores), so its row times an "
    "all-reduce of the whole array; its busbw still uses the reduce-scatter factor (n-1)/n")


def _check_op(op: str) -> None:
    if op not in _BUS_FACTORS:
        raise ValueError(f"unknown collective {op!r}; valid: {', '.join(COLLECTIVES)}")


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for collective ``op`` over ``n`` ranks (nccl-tests, doc/PERFORMANCE.md)."""
    _check_op(op)
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise ValueError(f"the number of ranks must be an integer >= 1, got {n!r}")
    return _BUS_FACTORS[op](int(n))


def algbw(size_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth ``S / t`` in bytes per second (``S``: the whole array)."""
    if size_bytes < 0:
        raise ValueError(f"size must be >= 0 bytes, got {size_bytes}")
    if not seconds > 0:
        raise ValueError(f"time must be > 0 seconds, got {seconds}")
    return size_bytes / seconds


def busbw(op: str, size_bytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in bytes per second: ``algbw x`` :func:`bus_factor`."""
    return algbw(size_bytes, seconds) * bus_factor(op, n)


_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024 ** 2, "MB": 1024 ** 2,
          "MIB": 1024 ** 2, "G": 1024 ** 3, "GB": 1024 ** 3, "GIB": 1024 ** 3}


def parse_size(text) -> int:
    """``"64K"`` -> 65536 (binary units, as nccl-tests' ``-b``/``-e``); ints pass through."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip().upper()
        digits = s.rstrip("KMGIB")
        unit = s[len(digits):]
        if not digits.isdigit() or unit not in _UNITS:
            raise ValueError(f"size {text!r} is not a byte count such as 1024, 64K, 16M or 1G")
        value = int(digits) * _UNITS[unit]
    if value < 1:
        raise ValueError(f"size must be >= 1 byte, got {text!r}")
    return value


def message_sizes(min_bytes, max_bytes, factor: int = 2) -> List[int]:
    """``min, min*factor, ...`` up to ``max`` (both in bytes or as ``"64K"``-style strings)."""
    lo, hi = parse_size(min_bytes), parse_size(max_bytes)
    if lo > hi:
        raise ValueError(f"minimum size {lo} bytes is larger than the maximum {hi} bytes")
    if factor < 2:
        raise ValueError(f"the size factor must be >= 2, got {factor}")
    sizes = [lo]
    while sizes[-1] * factor <= hi:
        sizes.append(sizes[-1] * factor)
    return sizes


def collective_numel(op: str, size_bytes: int, n: int, element_size: int) -> Tuple[int, int]:
    """``(numel of each rank's input tensor, whole-array bytes S actually moved)`` for a
    benchmark of ``op`` at nominal size ``size_bytes``: all-reduce and broadcast take the whole
    array, all-gather an ``S/n`` piece per rank, reduce-scatter the whole array (its output is
    ``S/n``). ``S`` is rounded down to a multiple of ``n`` elements (at least ``n``)."""
    _check_op(op)
    total = max(size_bytes // element_size, 1)
    if op in ("all_gather", "reduce_scatter"):
        total = max(total - total % n, n)
    per_rank = total // n if op == "all_gather" else total
    return per_rank, total * element_size


def _human_bytes(n: int) -> str:
    for unit, scale in (("G", 1024 ** 3), ("M", 1024 ** 2), ("K", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def format_bandwidth(rows: Sequence[Dict[str, Any]]) -> str:
    """The benchmark's rows as a table (time in microseconds, bandwidths in GB/s = 1e9 B/s)."""
    lines = [f"{'op':>15} {'size':>6} {'ranks':>5} {'time (us)':>11} {'algbw GB/s':>11} "
             f"{'busbw GB/s':>11}"]
    for r in rows:
        lines.append(f"{r['op']:>15} {_human_bytes(r['size_bytes']):>6} {r['ranks']:>5} "
                     f"{r['time_s'] * 1e6:11.1f} {r['algbw'] / 1e9:11.3f} {r['busbw'] / 1e9:11.3f}")
    return "\n".join(lines)


def best_busbw(rows: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """Per collective, the highest busbw over the message sizes (bytes/s)."""
    out: Dict[str, float] = {}
    for r in rows:
        out[r["op"]] = max(out.get(r["op"], 0.0), r["busbw"])
    return out


# --------------------------------------------------------------------------- step breakdown
# The in-rank timer lives with the training code (mpu_lab.timers); these names are read here.
from mpu_lab.timers import (CATEGORY_ORDER, COMPUTE, OTHER, WAIT, StepTimer,  # noqa: E402,F401
                            categorize)


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


# --------------------------------------------------------------------------- utilisation
@dataclasses.dataclass
class Utilisation:
    """Samples of how busy each rank was: ``values[rank][i]`` at ``times[i]`` (``time.time()``),
    NaN where the rank's process did not exist (yet). ``kind`` is ``"cpu"`` (percent of one
    core, psutil; above 100 when a rank runs several threads), ``"runnable"`` (100 when the
    rank's main thread was running or waiting for a core at the sample, 0 when it was blocked,
    e.g. in a collective: what the rank *wanted* to do, whatever other processes took) or
    ``"gpu"`` (NVML's percent of time a kernel ran on the rank's GPU); ``"schedule"`` for the
    ideal pictures of :func:`schedule_utilisation`. ``machine[i]``: the whole machine's CPU
    use, percent of all its ``cores`` (every process, not only the job's: it shows contention).
    """
    kind: str
    interval_s: float
    times: List[float]
    values: Dict[int, List[float]]
    cores: int
    machine: List[float] = dataclasses.field(default_factory=list)

    def crop(self, start: float, end: float) -> "Utilisation":
        """The samples between ``start`` and ``end`` (e.g. :func:`training_window`)."""
        keep = [i for i, t in enumerate(self.times) if start <= t <= end]
        return Utilisation(self.kind, self.interval_s, [self.times[i] for i in keep],
                           {r: [v[i] for i in keep] for r, v in self.values.items()}, self.cores,
                           [self.machine[i] for i in keep] if self.machine else [])

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
    back-to-back runs of the logical schedule of lab 06
    (:func:`mpu_lab.pipeline_parallel.timeline.simulate`; a forward takes one time slot).
    ``times`` are in slots, sampled ``samples_per_slot`` times per slot (mid-points)."""
    from mpu_lab.pipeline_parallel.timeline import simulate
    timeline = simulate(schedule, p, m, v)
    length = max(float(r[4]) for rank in timeline.records for r in rank)
    n = int(round(length * samples_per_slot)) * iterations
    times = [(i + 0.5) / samples_per_slot for i in range(n)]
    values = {}
    for rank, records in enumerate(timeline.records):
        spans = [(float(r[3]), float(r[4])) for r in records]
        values[rank] = [100.0 if any(a <= t % length < b for a, b in spans) else 0.0 for t in times]
    return Utilisation("schedule", 1.0 / samples_per_slot, times, values, cores=p)


def _worker_rank(proc) -> Optional[int]:
    """The global rank of a torchrun worker (from the variables torchrun sets for workers
    only: ``ROLE_RANK`` is not inherited from a notebook), None for anything else."""
    try:
        env = proc.environ()
    except Exception:   # gone, or not ours
        return None
    if "ROLE_RANK" not in env or "RANK" not in env:
        return None
    return int(env["RANK"])


class UtilisationSampler:
    """Sample, on a background thread of *this* process, how busy the ranks of the
    ``torchrun`` jobs started from it are:

        with UtilisationSampler(interval_s=0.05) as sampler:
            job = launch.run("train_gpt.py", flags, nproc=4)
        util = sampler.result()

    CPU: every ``interval_s`` the worker processes are found among this process's descendants
    (:func:`mpu_lab.launch.descendants`; a worker is a process with torchrun's ``ROLE_RANK``)
    and psutil reads, per ``cpu_metric``, their CPU use since the last sample (``"cpu"``) or
    whether their main thread is running or runnable now (``"runnable"``). GPU (``gpu=True``, or
    ``"auto"``: where NVML finds one): NVML's utilisation of each rank's GPU, ``LOCAL_RANK``
    modulo the GPU count as :func:`mpu_lab.distributed.choose_device` assigns them (NVML
    numbers GPUs by PCI bus; set ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA agrees).
    """

    def __init__(self, interval_s: float = 0.05, gpu="auto", root_pid: Optional[int] = None,
                 cpu_metric: str = "cpu"):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if gpu not in ("auto", True, False):
            raise ValueError(f"gpu must be 'auto', True or False, got {gpu!r}")
        if cpu_metric not in ("cpu", "runnable"):
            raise ValueError(f"cpu_metric must be 'cpu' or 'runnable', got {cpu_metric!r}")
        self.interval_s = interval_s
        self.root_pid = os.getpid() if root_pid is None else root_pid
        self._gpu_handles = self._open_nvml() if gpu else []
        if gpu is True and not self._gpu_handles:
            raise ValueError("gpu=True but NVML finds no GPU here; use gpu='auto' or False")
        self.kind = "gpu" if self._gpu_handles else cpu_metric
        self.times: List[float] = []
        self.values: Dict[int, List[float]] = {}
        self.machine: List[float] = []
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
        import psutil

        from mpu_lab.launch import descendants
        for pid in descendants(self.root_pid):
            if pid in self._rank_of or pid in self._procs:
                continue
            try:
                proc = psutil.Process(pid)
            except psutil.Error:
                continue
            rank = _worker_rank(proc)
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
            try:
                self._local_rank[rank] = int(proc.environ().get("LOCAL_RANK", rank))
                proc.cpu_percent(None)           # the first call only starts the clock
            except psutil.Error:
                pass

    def _sample(self):
        import psutil
        now = time.time()
        row: Dict[int, float] = {}
        if self._gpu_handles:
            import pynvml
            util = [pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._gpu_handles]
            for rank, local in self._local_rank.items():
                row[rank] = float(util[local % len(util)])
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
                           os.cpu_count() or 1, list(self.machine))


def run_with_utilisation(script, args: Sequence = (), nproc: int = 2, interval_s: float = 0.05,
                         gpu="auto", cpu_metric: str = "cpu", **run_kwargs):
    """:func:`mpu_lab.launch.run` with a :class:`UtilisationSampler` around it; returns
    ``(job, utilisation)``."""
    from mpu_lab import launch
    with UtilisationSampler(interval_s=interval_s, gpu=gpu, cpu_metric=cpu_metric) as sampler:
        job = launch.run(script, args, nproc=nproc, **run_kwargs)
    return job, sampler.result()


# --------------------------------------------------------------------------- one profiled run
@dataclasses.dataclass
class ProfiledRun:
    """A ``train_gpt.py --breakdown`` job with its utilisation samples: ``reports`` (each
    rank's breakdown), ``utilisation`` (cropped to the timed steps), ``metrics`` (rank 0's
    logged iterations) and the job's wall-clock ``elapsed_s``."""
    label: str
    nproc: int
    reports: List[dict]
    utilisation: Utilisation
    metrics: List[dict]
    elapsed_s: float

    @property
    def step_s(self) -> float:
        """The median timed step of the slowest rank (every rank's step ends together in a
        synchronous run, so they agree to a few per cent)."""
        return max(sorted(r["step_seconds"])[len(r["step_seconds"]) // 2] for r in self.reports)

    def calls(self, rank: int = 0) -> Dict[str, int]:
        """Communication calls per step of one rank, by category (deterministic)."""
        return {k: int(round(v)) for k, v in sorted(self.reports[rank]["calls"].items())}

    @property
    def on_gpu(self) -> bool:
        return any(r.get("device", "cpu").startswith("cuda") for r in self.reports)


def training_flags(tc) -> List[str]:
    """``train_gpt.py`` flags of a :class:`mpu_lab.perf.calibrate.TrainConfig`, without its
    metrics file."""
    return tc.argv()


def format_utilisation(runs: Dict[str, ProfiledRun]) -> str:
    """Per run: each rank's mean utilisation over the timed steps; for CPU percentages also the
    job's total and how much of the machine other processes took meanwhile (contention: it
    slows the run), for the runnable share how busy the whole machine was."""
    lines = []
    for label, run in runs.items():
        util = run.utilisation
        means = util.mean()
        ranks = "  ".join(f"rank {r} {v:3.0f}%" for r, v in means.items())
        machine = sum(util.machine) / len(util.machine) if util.machine else None
        if util.kind == "cpu":
            line = f"{label}: {ranks}  | job {sum(means.values()):4.0f}%"
            if machine is not None:
                line += (f" of {100 * util.cores}% ({util.cores} cores); other processes "
                         f"{max(0.0, machine * util.cores - sum(means.values())):3.0f}%")
        else:
            line = f"{label}: {ranks}"
            if machine is not None:
                line += f"  | machine {machine:3.0f}% busy ({util.cores} cores)"
        lines.append(line)
    return "\n".join(lines)


def profile_training(flags: Sequence, nproc: int, label: str = "", interval_s: float = 0.05,
                     barrier: bool = False, cpu_metric: str = "cpu", **run_kwargs) -> ProfiledRun:
    """Run ``launch/train_gpt.py`` with ``flags`` plus ``--breakdown`` (or
    ``--breakdown-barrier``) on ``nproc`` ranks under a :class:`UtilisationSampler`
    (``cpu_metric``: see :class:`Utilisation`)."""
    from mpu_lab import training
    flags = [str(f) for f in flags] + ["--breakdown-barrier" if barrier else "--breakdown"]
    training.validate_args(training.parse_args(flags), nproc)   # a bad line fails here
    run_kwargs.setdefault("show", "none")
    job, util = run_with_utilisation("train_gpt.py", flags, nproc=nproc, interval_s=interval_s,
                                     cpu_metric=cpu_metric, **run_kwargs)
    reports = breakdowns(job.results)
    return ProfiledRun(label, nproc, reports, util.crop(*training_window(reports)),
                       job.results[0]["metrics"], job.elapsed_s)


def allreduce_fit(rows: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """Latency and bus bandwidth of the all-reduce rows of ``launch/bench_bandwidth.py`` (the fit
    :func:`mpu_lab.perf.calibrate.calibrate_allreduce` uses; latency: the smaller of the two
    smallest messages' times; busbw: 2(n-1)/n · S / (t - latency) of the largest), so a
    benchmark already run can calibrate :func:`mpu_lab.perf.calibrate.cpu_cluster`."""
    mine = sorted((r for r in rows if r["op"] == "all_reduce"), key=lambda r: r["size_bytes"])
    if len(mine) < 2:
        raise ValueError("need all_reduce rows of at least two sizes (run bench_bandwidth.py "
                         "with --ops all_reduce and --max-bytes > --min-bytes)")
    latency = min(r["time_s"] for r in mine[:2])
    big, n = mine[-1], mine[-1]["ranks"]
    busbw_ = bus_factor("all_reduce", n) * big["size_bytes"] / max(big["time_s"] - latency, 1e-9)
    return dict(latency_s=latency, busbw=busbw_, nproc=n,
                rows=[(r["size_bytes"], r["time_s"]) for r in mine])


# The model's causes next to the breakdown's categories.
_MODEL_TO_MEASURED = {"compute": (COMPUTE,), "tp_comm": ("tp all_reduce", "tp all_gather",
                      "tp reduce_scatter", "tp broadcast"), "pp_p2p+bubble": ("pp p2p",),
                      "dp_comm": ("dp all_reduce",)}


def measured_vs_predicted(run: ProfiledRun, prediction) -> Dict[str, Any]:
    """A measured run next to the cost model's prediction for it
    (:class:`mpu_lab.perf.model.IterationPrediction`): step seconds, their ratio, and per cause
    the predicted seconds and the measured seconds of the matching categories (rank 0; the
    measured p2p time holds the bubble, so it is compared with the model's p2p + bubble)."""
    pred = prediction.breakdown()
    pred["pp_p2p+bubble"] = pred.pop("pp_p2p") + pred.pop("bubble")
    pred["compute"] += pred.pop("optimizer")
    parts = run.reports[0]["parts"]
    causes = {k: dict(predicted_s=pred.get(k, 0.0),
                      measured_s=sum(parts.get(c, 0.0) for c in cats))
              for k, cats in _MODEL_TO_MEASURED.items()}
    return dict(label=run.label, measured_s=run.step_s, predicted_s=prediction.total_s,
                ratio=run.step_s / prediction.total_s, causes=causes)


def format_measured_vs_predicted(rows: Sequence[Dict[str, Any]]) -> str:
    """Rows of :func:`measured_vs_predicted` as a table, milliseconds."""
    causes = list(_MODEL_TO_MEASURED)
    lines = [f"{'run':<30}{'measured ms':>12}{'predicted ms':>13}{'ratio':>7}   "
             + "  ".join(f"{c + ' m/p':>22}" for c in causes)]
    for r in rows:
        cells = [f"{r['causes'][c]['measured_s'] * 1e3:9.1f}/"
                 f"{r['causes'][c]['predicted_s'] * 1e3:<9.1f}" for c in causes]
        lines.append(f"{r['label']:<30}{r['measured_s'] * 1e3:12.1f}{r['predicted_s'] * 1e3:13.1f}"
                     f"{r['ratio']:7.2f}   " + "  ".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def compare_with_model(configs: Dict[str, Any], runs: Dict[str, ProfiledRun],
                       bandwidth_rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Predict each measured CPU run with the cost model calibrated on this machine and put
    the two side by side (:func:`measured_vs_predicted`).

    ``configs``: label -> :class:`mpu_lab.perf.calibrate.TrainConfig` (the shapes of the runs
    in ``runs``, same labels). The calibration, for :func:`mpu_lab.perf.calibrate.cpu_cluster`:
    the matmul FLOP/s of each model's own layer GEMMs and the memory bandwidth, measured here
    with the threads each rank gets and scaled by the share of a core each rank gets when
    there are more ranks than cores; the all-reduce latency and bandwidth fitted
    (:func:`allreduce_fit`) on ``bandwidth_rows`` of ``launch/bench_bandwidth.py`` at the
    same number of ranks. fp32 on a CPU: 4-byte activations and gradients."""
    from mpu_lab.perf import calibrate
    from mpu_lab.perf.model import predict_iteration
    if any(run.on_gpu for run in runs.values()):
        raise ValueError("compare_with_model calibrates a CPU; these runs used GPUs")
    fit = allreduce_fit(bandwidth_rows)
    cores = os.cpu_count() or 1
    rows = []
    for label, tc in configs.items():
        run = runs[label]
        if run.nproc != fit["nproc"]:
            raise ValueError(f"{label}: {run.nproc} ranks, but the bandwidth rows were measured "
                             f"on {fit['nproc']}")
        model, cfg = tc.shapes()
        threads, share = max(1, cores // run.nproc), min(1.0, cores / run.nproc)
        flops = share * calibrate.calibrate_matmul(calibrate.layer_matmul_shapes(model, cfg),
                                                   threads=threads)
        memory = share * calibrate.calibrate_memory_bandwidth(threads=threads)
        cluster = calibrate.cpu_cluster(run.nproc, calibration=dict(
            nproc=run.nproc, matmul_flops=flops, memory_bandwidth=memory,
            latency_s=fit["latency_s"], busbw=fit["busbw"]))
        pred = predict_iteration(model, cfg, cluster, dtype_bytes=4, grad_bytes=4)
        rows.append(dict(measured_vs_predicted(run, pred), matmul_gflops=flops / 1e9))
    return rows
