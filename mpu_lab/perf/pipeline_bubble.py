"""The pipeline bubble measured on the machine a learner has, and predicted for one it has not.

    result = measure_bubble(pipeline_parallel_size=2, microbatches=(1, 8))   # a torchrun job
    print(result.summary())
    predicted = predicted_timeline(GPT3_1_3B, pipeline_parallel_size=4, num_microbatches=8)

A bubble is time a stage waits. On a GPU a waiting stage leaves its GPU idle; on a CPU with more
ranks than cores a waiting rank hands its core to another rank, so the bubble costs almost no
wall time and cannot be seen. :func:`measure_bubble` therefore sizes the run to the machine:
``p`` ranks, each pinned to a core of its own with one thread (:func:`pin_this_rank`, with
:mod:`mpu_lab.perf.rank_clock`'s pinning), running
the toy model (:mod:`mpu_lab.perf.pipeline_toy`, made wide enough that a forward takes
milliseconds) through mpu_lab's 1F1B. Each rank reads its own clocks around every iteration:
the wall time between two barriers, and its busy time, twice: the forwards and backwards
recorded by :class:`~mpu_lab.perf.pipeline_timeline.ScheduleRecorder`'s hooks, and the CPU
time of its main thread (a rank waiting for a message sleeps and uses none). The idle share
``1 - Σ busy / Σ wall`` then sits next to the formula ``(p-1)/(m+p-1)``
(:func:`~mpu_lab.perf.pipeline_simulation.analytic_bubble`).

Where the machine has fewer cores than ranks, :attr:`BubbleMeasurement.oversubscribed` says
so, and :func:`predicted_timeline` gives the same schedule on a DGX H100 instead: the cost
model's compute time of one micro-batch on one stage (:func:`~mpu_lab.perf.cost_model.
predict_iteration`) fed to the logical simulator (:func:`~mpu_lab.perf.pipeline_simulation.
simulate`) — a prediction, not a measurement.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Dict, List, Optional, Sequence

import torch

from mpu_lab.training import initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state as ps
from mpu_lab.perf import rank_clock
from mpu_lab.perf.cost_model import DGX_H100, Cluster, ModelShape, ParallelConfig, predict_iteration
from mpu_lab.perf.pipeline_timeline import ScheduleRecorder
from mpu_lab.core.pipeline_parallel.schedules import (
    forward_backward_pipelining_without_interleaving)
from mpu_lab.perf.pipeline_simulation import LogicalTimeline, analytic_bubble, simulate
from mpu_lab.perf.pipeline_toy import (
    ToyConfig, ToyModel, build_toy_model_chunks, toy_batches, toy_forward_step)

# Wide enough that one forward of a stage takes tens of milliseconds on one core, so the
# messages between the stages (1 MiB on the loopback) are small beside it.
TIMING_TOY = ToyConfig(num_layers=8, hidden_size=512, vocab_size=64)
SEQ_LENGTH, MICRO_BATCH = 64, 8

# A 1.3-billion-parameter GPT (24 layers, h = 2048, GPT-3 "XL"): one pipeline stage of it per
# H100 is small enough to predict a clear timeline.
GPT3_1_3B = ModelShape(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                       vocab_size=51200, name="GPT-3 XL (1.3 B)")


# --------------------------------------------------------------------------- rank side
def pin_this_rank() -> Optional[int]:
    """On a CPU rank: pin this process to a core of its own (``LOCAL_RANK`` modulo the cores it
    may use) with one thread, so it never waits for a core; returns the core (``None`` on a
    GPU rank, or where the OS cannot pin). Call it before the process group is made, so the
    communication threads inherit the pinning."""
    if initialize.get_device().type == "cuda":
        return None
    core = rank_clock.core_for(int(os.environ.get("LOCAL_RANK", "0")))
    if not rank_clock.pin_process(os.getpid(), core):
        return None
    torch.set_num_threads(1)
    return core


def time_iterations(num_microbatches: int, iterations: int = 3, warmup: int = 1,
                    seed: int = 1234) -> Dict[str, object]:
    """Runs inside every rank of one pipeline (mpu_lab's groups made): ``warmup`` + ``iterations``
    1F1B iterations of :data:`TIMING_TOY`. Returns this rank's per-iteration ``wall_s`` (barrier
    to barrier), ``busy_s`` (the recorded forwards and backwards), ``cpu_s`` (its main thread's
    CPU time; ``None`` on a GPU, where waiting for a kernel may spin) and the last iteration's
    ``records`` (for a Gantt chart)."""
    p, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    device = initialize.get_device()
    dense = ToyModel(TIMING_TOY, seed=seed)
    (chunk,) = build_toy_model_chunks(dense, rank, p, device=device)
    batches = toy_batches(TIMING_TOY, num_microbatches, SEQ_LENGTH, MICRO_BATCH, seed=seed,
                          device=device)
    group = ps.get_pipeline_model_parallel_group()
    out: Dict[str, List] = {"wall_s": [], "busy_s": [], "cpu_s": []}
    with ScheduleRecorder(chunk, num_microbatches, schedule="1f1b") as recorder:
        for i in range(warmup + iterations):
            chunk.zero_grad(set_to_none=True)
            torch.distributed.barrier(group=group)
            wall, cpu = time.perf_counter(), time.thread_time()
            forward_backward_pipelining_without_interleaving(
                forward_step_func=toy_forward_step, data_iterator=iter(batches), model=chunk,
                num_microbatches=num_microbatches, seq_length=SEQ_LENGTH,
                micro_batch_size=MICRO_BATCH)
            cpu = time.thread_time() - cpu
            torch.distributed.barrier(group=group)   # the iteration ends when the last stage does
            wall = time.perf_counter() - wall
            if i >= warmup:
                out["wall_s"].append(wall)
                out["busy_s"].append(sum(r[4] - r[3] for r in recorder.records))
                out["cpu_s"].append(cpu if device.type == "cpu" else None)
        out["records"] = [list(r) for r in recorder.records]
    return out


# --------------------------------------------------------------------------- driver side
def _count(n: int, word: str) -> str:
    """``"1 GPU"``, ``"2 GPUs"``."""
    return f"{n} {word}{'s' if n > 1 else ''}"


def machine_note(ranks: int, env: Optional[Dict[str, str]] = None) -> str:
    """One sentence: whether this machine gives each of ``ranks`` ranks a processor of its own
    (a GPU, or else a CPU core), so that a measured timeline's gaps are a bubble; on cores, and
    the load average above their number, it adds that other processes take turns on them. The ranks'
    devices follow :func:`mpu_lab.training.initialize.choose_device` (``MPU_LAB_DEVICE=cpu``, in ``env``
    or this process's environment, keeps them on the CPU): more ranks than GPUs share them."""
    on_cpu = {**os.environ, **(env or {})}.get("MPU_LAB_DEVICE") == "cpu"
    gpus = 0 if on_cpu else torch.cuda.device_count()
    cores = len(rank_clock.usable_cores())
    if (gpus or cores) >= ranks:
        n, kind = (gpus, "GPU") if gpus else (cores, "CPU core")
        note = (f"{_count(ranks, 'rank')} on {_count(n, kind)}: "
                f"one each, so the measured gaps are the bubble.")
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        if not gpus and load > cores:
            note += (f"\nBut the load average is {load:.1f} on {cores} cores now: other "
                     f"processes take\nturns on them, and the gaps include those turns.")
        return note
    shared = (f"{_count(gpus, 'GPU')}: the ranks share "
              f"{'them' if gpus > 1 else 'it'}" if gpus else
              f"{cores} CPU cores and no GPU: the ranks share cores")
    return (f"{ranks} ranks on {shared}, so the measured chart is not a bubble.\nBelow it, the "
            f"same schedule PREDICTED for a DGX H100.")


@dataclasses.dataclass
class BubbleRun:
    """One micro-batch count: the idle shares of each measured iteration (median reported)."""

    num_microbatches: int
    formula: float
    from_hooks: List[float]
    from_cpu_time: Optional[List[float]]
    records: List[List[tuple]]

    @property
    def measured(self) -> float:
        return statistics.median(self.from_hooks)

    @property
    def measured_cpu(self) -> Optional[float]:
        return statistics.median(self.from_cpu_time) if self.from_cpu_time else None


@dataclasses.dataclass
class BubbleMeasurement:
    """What :func:`measure_bubble` found: per micro-batch count, the measured idle share next to
    ``(p-1)/(m+p-1)``; the cores the ranks were pinned to and the devices they computed on;
    whether the job had more ranks than the machine has processors for them (cores, or GPUs)."""

    pipeline_parallel_size: int
    runs: List[BubbleRun]
    cores: List[Optional[int]]
    cores_available: int
    devices: List[str] = dataclasses.field(default_factory=list)   # per rank, "cpu" or "cuda:i"

    @property
    def gpus(self) -> List[str]:
        """The distinct GPUs the ranks computed on (none on the CPU)."""
        return sorted({d for d in self.devices if d.startswith("cuda")})

    @property
    def oversubscribed(self) -> bool:
        """More ranks than processors: ranks sharing a GPU, or more ranks than cores."""
        if self.gpus:
            return self.pipeline_parallel_size > len(self.gpus)
        return self.pipeline_parallel_size > self.cores_available

    @property
    def placement(self) -> str:
        """Where the stages ran, in a few words (for a chart's title)."""
        p, gpus = self.pipeline_parallel_size, self.gpus
        if gpus:
            return ("one GPU per stage" if not self.oversubscribed else
                    f"{p} stages sharing {_count(len(gpus), 'GPU')}")
        if any(c is None for c in self.cores):
            return "stages not pinned to cores"
        return ("one core per stage" if not self.oversubscribed else
                f"{p} stages on {self.cores_available} core(s)")

    def summary(self, tol: float = 0.1) -> str:
        """A few lines: how the ranks ran, then one row per micro-batch count."""
        p, gpus = self.pipeline_parallel_size, self.gpus
        if gpus:
            how = (f"one GPU each ({', '.join(gpus)})" if not self.oversubscribed else
                   f"sharing {_count(len(gpus), 'GPU')} ({', '.join(gpus)}): "
                   f"MORE RANKS THAN GPUS, the timing is not a bubble")
            head = f"1F1B, p = {p} stages, {how}."
        else:
            if any(c is None for c in self.cores):
                how = "on the CPU, not pinned to cores (this system refused the pinning)"
            else:
                how = (f"each pinned to a core of its own with one thread (cores "
                       f"{', '.join(str(c) for c in self.cores)})")
            head = (f"1F1B, p = {p} stages, {how}; this machine has {self.cores_available} "
                    f"core(s){': MORE RANKS THAN CORES, the timing is not a bubble' if self.oversubscribed else ''}.")
        lines = [head,
                 f"{'m':>4}  {'(p-1)/(m+p-1)':>13}  {'measured idle share':>19}  "
                 f"{'from CPU time':>13}  within {tol} of the formula?"]
        for run in self.runs:
            cpu = f"{run.measured_cpu:.2f}" if run.measured_cpu is not None else "-"
            ok = abs(run.measured - run.formula) <= tol
            lines.append(f"{run.num_microbatches:>4}  {run.formula:>13.2f}  {run.measured:>19.2f}  "
                         f"{cpu:>13}  {'yes' if ok else 'NO'}")
        if any(r.measured_cpu is not None and r.measured_cpu - r.measured > tol for r in self.runs):
            lines.append("The CPU-time share is the larger: a rank was also off its core while it "
                         "had work (other processes on this machine), which its own wall clock "
                         "counts as idle.")
        return "\n".join(lines)


def idle_share(per_rank: Sequence[Dict[str, List]], key: str) -> List[float]:
    """Per iteration, ``1 - Σ_ranks busy / Σ_ranks wall`` with busy read from ``key``."""
    n = len(per_rank[0]["wall_s"])
    return [1 - sum(r[key][i] for r in per_rank) / sum(r["wall_s"][i] for r in per_rank)
            for i in range(n)]


def measure_bubble(pipeline_parallel_size: int = 2, microbatches: Sequence[int] = (1, 8),
                   iterations: int = 3, env: Optional[Dict[str, str]] = None) -> BubbleMeasurement:
    """Launch ``launch/pipeline_bubble.py`` with ``pipeline_parallel_size`` ranks (one pipeline)
    and measure the 1F1B bubble at each micro-batch count."""
    if pipeline_parallel_size < 2:
        raise ValueError(f"a bubble needs at least 2 pipeline stages, got {pipeline_parallel_size}")
    bad = [m for m in microbatches if not isinstance(m, int) or m < 1]
    if bad or not microbatches:
        raise ValueError(f"microbatches must be positive integers, got {list(microbatches)}")
    job = launcher.run("pipeline_bubble.py",
                       ["--microbatches", *map(str, microbatches), "--iterations", str(iterations)],
                       nproc=pipeline_parallel_size, show="none", env=env)
    reports = job.results
    runs = []
    for k, m in enumerate(microbatches):
        per_rank = [r["runs"][k] for r in reports]
        on_cpu = all(x is not None for r in per_rank for x in r["cpu_s"])
        runs.append(BubbleRun(m, float(analytic_bubble(pipeline_parallel_size, m)["share"]),
                              idle_share(per_rank, "busy_s"),
                              idle_share(per_rank, "cpu_s") if on_cpu else None,
                              [[tuple(x) for x in r["records"]] for r in per_rank]))
    return BubbleMeasurement(pipeline_parallel_size, runs, [r["core"] for r in reports],
                             reports[0]["cores_available"], [r["device"] for r in reports])


def predicted_timeline(model: ModelShape = GPT3_1_3B, pipeline_parallel_size: int = 4,
                       num_microbatches: int = 8, micro_batch_size: int = 1,
                       cluster: Cluster = DGX_H100, schedule: str = "1f1b",
                       num_model_chunks: int = 1) -> LogicalTimeline:
    """The schedule's timeline predicted for ``cluster`` (one GPU per stage, no tensor or data
    parallelism): the cost model's compute time of one micro-batch through one stage, split
    one third forward, two thirds backward (the backward computes two gradients per matmul),
    fed to :func:`~mpu_lab.perf.pipeline_simulation.simulate` (``schedule``, with
    ``num_model_chunks`` per stage when interleaved). Times are in seconds; the point-to-point
    messages are left out (on NVLink they take microseconds)."""
    p, m, v = pipeline_parallel_size, num_microbatches, num_model_chunks
    cfg = ParallelConfig(tp=1, pp=p, dp=1, micro_batch_size=micro_batch_size,
                         global_batch_size=micro_batch_size * m, virtual_stages=v)
    per_microbatch = predict_iteration(model, cfg, cluster).compute_s / m
    return simulate(schedule, p, m, v, forward_time=per_microbatch / 3,
                    backward_time=2 * per_microbatch / 3)
