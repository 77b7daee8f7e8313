"""The MPU walkthrough's opening story, measured: a bad split of a GPT, its remedy, a good split.

The same model, the same batch, the same number of ranks n; only the split differs
(Narayanan et al. 2021 §2.2 for the bubble):

* **bad** — a pipeline of n stages fed the whole batch as one micro-batch: each stage waits
  while the others work, busy m/(m + n − 1) = 1/n of the step;
* **remedy** — the same pipeline fed m micro-batches (1F1B): busy m/(m + n − 1);
* **good** — n data-parallel replicas: no bubble, one gradient all-reduce per step.

That is a lesson about time, so it needs a device per rank. On a CPU the device is a core:
:func:`timing_ranks` sizes the job to the usable cores (and says so when it had to), and
:func:`run_bad_vs_good` pins every rank to a core of its own, with one thread (the launcher
sets ``OMP_NUM_THREADS`` to cores / ranks), and reads each rank's busy and idle time from its
own CPU clock (:mod:`mpu_lab.perf.rank_clock`). On GPUs it samples NVML's utilisation.

:func:`speedup_line` is the verdict ``launch/utilisation.py`` and lab 15 end with.

Where the machine has fewer cores than the walkthrough has GPUs, :func:`predicted_bad_vs_remedy`
gives the bad and the remedy pipeline as a DGX H100 would run them (one stage per GPU): the
cost model's compute time per micro-batch fed to the 1F1B simulator
(:func:`mpu_lab.perf.pipeline_bubble.predicted_timeline`) — a prediction, not a measurement.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from mpu_lab.perf.calibrate import calibrate_matmul
from mpu_lab.perf.cost_model import DGX_H100, Cluster, ModelShape, flops_per_token
from mpu_lab.perf.pipeline_bubble import GPT3_1_3B, predicted_timeline
from mpu_lab.perf.rank_clock import cores_note, usable_cores
from mpu_lab.perf.runs import ProfiledRun, profile_training, training_flags
from mpu_lab.perf.step_time import TrainConfig
from mpu_lab.perf.pipeline_simulation import LogicalTimeline
from mpu_lab.perf.utilisation import Utilisation
from mpu_lab.training.initialize import DEFAULT_TIMEOUT_S

__all__ = ["ROLES", "timing_ranks", "bad_vs_good_configs", "run_bad_vs_good", "role_of",
           "fastest_step_s", "mean_step_s", "speedups", "speedup_line", "format_steps", "format_busy_idle",
           "schedule_busy_share", "WALKTHROUGH_GPUS", "predicted_bad_vs_remedy",
           "predicted_speedup", "format_predicted", "measured_vs_predicted_line"]

ROLES = ("bad", "remedy", "good")

# The walkthrough's machine: one DGX H100, 8 GPUs, a pipeline stage on each.
WALKTHROUGH_GPUS = 8


def timing_ranks(requested: int, on_gpu: bool, cores: Optional[int] = None
                 ) -> Tuple[int, Optional[str]]:
    """How many ranks a timing lesson runs, and a note when that is not ``requested``.

    On GPUs: ``requested`` (a device per rank is the launcher's business). On a CPU: at most
    the usable cores (:func:`mpu_lab.perf.rank_clock.usable_cores`), and at least 2 (a pipeline
    needs two stages; then :func:`mpu_lab.perf.rank_clock.cores_note` says what is lost)."""
    if requested < 2:
        raise ValueError(f"a pipeline against data parallelism needs at least 2 ranks, "
                         f"got {requested}")
    if on_gpu:
        return requested, None
    cores = len(usable_cores()) if cores is None else cores
    n = max(2, min(requested, cores))
    if n == requested:
        return n, cores_note(n, cores)
    note = (f"this machine has {cores} usable CPU cores: a timing lesson runs one rank per "
            f"core, so these jobs use {n} ranks, not {requested}")
    if n > cores:
        note += "; " + cores_note(n, cores)
    return n, note


def bad_vs_good_configs(nproc: int, num_layers: int, hidden_size: int,
                        num_attention_heads: int, seq_length: int, vocab_size: int,
                        global_batch_size: int, train_iters: int, microbatches: int = 8
                        ) -> Dict[str, TrainConfig]:
    """``{label: TrainConfig}`` of the three runs, in :data:`ROLES` order. The remedy takes the
    most micro-batches up to ``microbatches`` that divide ``global_batch_size``."""
    if num_layers % nproc or global_batch_size % nproc:
        raise ValueError(f"{nproc} ranks must divide --num-layers {num_layers} (one pipeline "
                         f"stage each) and --global-batch-size {global_batch_size} (one share "
                         f"per data-parallel rank)")
    if microbatches < 2:
        raise ValueError(f"the remedy needs at least 2 micro-batches, got {microbatches}")
    m = max(k for k in range(1, microbatches + 1) if global_batch_size % k == 0)
    if m < 2:
        raise ValueError(f"--global-batch-size {global_batch_size} cannot be cut into 2 to "
                         f"{microbatches} equal micro-batches")
    shape = dict(num_layers=num_layers, hidden_size=hidden_size,
                 num_attention_heads=num_attention_heads, seq_length=seq_length,
                 vocab_size=vocab_size, global_batch_size=global_batch_size,
                 train_iters=train_iters)
    return {f"bad: PP={nproc}, 1 micro-batch": TrainConfig(
                pp=nproc, micro_batch_size=global_batch_size, **shape),
            f"remedy: PP={nproc}, {m} micro-batches": TrainConfig(
                pp=nproc, micro_batch_size=global_batch_size // m, **shape),
            f"good: DP={nproc}": TrainConfig(
                dp=nproc, micro_batch_size=global_batch_size // nproc, **shape)}


def role_of(label: str) -> str:
    """``"bad"``, ``"remedy"`` or ``"good"``: the word before the label's colon."""
    role = label.split(":")[0].strip()
    if role not in ROLES:
        raise ValueError(f"a label starts with one of {', '.join(ROLES)} and a colon, got "
                         f"{label!r}")
    return role


def longest_wait_flops(tc: TrainConfig) -> float:
    """FLOPs of the longest stretch a pipeline rank waits through for one message: the last
    stage's forward and backward (3 x forward) of one micro-batch, which the first stage waits
    for after sending its activations (its L/p layers plus the logits; the cost model's matmul
    FLOPs per token). 0 for a run without pipeline stages."""
    if tc.pp < 2:
        return 0.0
    f = flops_per_token(tc.shapes()[0])
    per_token = tc.num_layers / tc.pp * f["layer"] / tc.tp + f["logits"] / tc.tp
    return 3.0 * tc.micro_batch_size * tc.seq_length * per_token


def dtype_of(flags: Sequence[str]) -> str:
    """The torch dtype name ``train_gpt.py``'s precision flags compute in."""
    flags = [str(f) for f in flags]
    return "bfloat16" if "--bf16" in flags else "float16" if "--fp16" in flags else "float32"


def refuse_past_timeout(configs: Dict[str, TrainConfig], extra_flags: Sequence[str] = (),
                        env: Optional[dict] = None, flops_per_s: Optional[float] = None) -> None:
    """On CPU ranks, raise ``ValueError`` before any run starts when a pipeline rank would
    wait longer for one message than the collective timeout allows (``MPU_LAB_TIMEOUT_S``,
    :data:`mpu_lab.training.initialize.DEFAULT_TIMEOUT_S` s by default): the longest wait
    (:func:`longest_wait_flops`) at ``flops_per_s``, by default this CPU's matmul rate on one
    thread (each rank gets one core) in the runs' dtype. GPU-sized shapes (the 8gpu profile's)
    would otherwise fail in the middle of the first run with gloo's receive timeout."""
    timeout_s = float(dict(os.environ, **(env or {})).get("MPU_LAB_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    waits = {label: longest_wait_flops(tc) for label, tc in configs.items()}
    label = max(waits, key=waits.get)
    if not waits[label]:
        return
    dtype = dtype_of(extra_flags)
    if flops_per_s is None:
        flops_per_s = calibrate_matmul(((1, 512, 512, 512),), threads=1, repeats=3, dtype=dtype)
    wait_s = waits[label] / flops_per_s
    if wait_s <= timeout_s:
        return
    tc = configs[label]
    raise ValueError(
        f"{label} would keep a rank waiting about {wait_s:.0f} s for one message on this CPU "
        f"(the last stage's forward and backward of one micro-batch: {waits[label]:.2g} FLOP "
        f"at {flops_per_s:.2g} FLOP/s, {dtype}, one core per rank), past the collective "
        f"timeout of {timeout_s:.0f} s (MPU_LAB_TIMEOUT_S). layers={tc.num_layers}, "
        f"hidden={tc.hidden_size}, seq_length={tc.seq_length}, "
        f"global_batch={tc.global_batch_size} are sized for GPUs: on a CPU use profile='cpu', "
        f"or smaller hidden, seq_length or global_batch, or raise MPU_LAB_TIMEOUT_S.")


def run_bad_vs_good(configs: Dict[str, TrainConfig], extra_flags: Sequence[str] = (),
                    interval_s: float = 0.05, env: Optional[dict] = None,
                    profile_dir: Optional[str] = None, **run_kwargs) -> Dict[str, ProfiledRun]:
    """Run each configuration (``train_gpt.py --breakdown`` plus ``extra_flags``) one after
    the other. Without GPUs every rank is pinned to its own core and sampled by its own CPU
    clock (``cpu_metric="clock"``); with GPUs NVML is sampled. ``env`` goes to the launcher.
    With ``profile_dir`` the timed steps also run under ``torch.profiler``, each run writing
    one trace per rank under ``profile_dir/<i>`` (the profiler slows every op: time the
    lesson's runs without it). On CPU ranks, a configuration that would outlast the collective
    timeout is refused before anything starts (:func:`refuse_past_timeout`)."""
    if not torch.cuda.is_available():
        refuse_past_timeout(configs, extra_flags, env)
    runs = {}
    for i, (label, tc) in enumerate(configs.items()):
        role_of(label)
        flags = [str(f) for f in extra_flags]
        if profile_dir is not None:
            flags += ["--breakdown-profile", os.path.join(profile_dir, str(i))]
        runs[label] = profile_training(training_flags(tc) + flags,
                                       tc.nproc, label, interval_s=interval_s,
                                       cpu_metric="clock", pin=True, env=env, **run_kwargs)
    return runs


PROFILED_ITERS = 3   # under the profiler: one warm-up iteration and two timed steps


def for_profiling(configs: Dict[str, TrainConfig], train_iters: int = PROFILED_ITERS
                  ) -> Dict[str, TrainConfig]:
    """The same runs with at most ``train_iters`` iterations, for :func:`run_bad_vs_good`'s
    ``profile_dir``. The profiler slows every op and its trace holds every op of every timed
    step; two timed steps are enough for each rank's timeline and for the split of a step by
    term, while the step times come from the runs without it."""
    if train_iters < 2:
        raise ValueError(f"train_iters must be at least 2 (a warm-up and a timed step), "
                         f"got {train_iters}")
    return {label: dataclasses.replace(tc, train_iters=min(tc.train_iters, train_iters))
            for label, tc in configs.items()}


def fastest_step_s(run: ProfiledRun) -> float:
    """The fastest timed step: step i lasts as long as its slowest rank, and the least disturbed
    of them is what the split costs when nothing else runs (timeit's reasoning)."""
    per_step = zip(*(r["step_seconds"] for r in run.reports))
    return min(max(times) for times in per_step)


def mean_step_s(run: ProfiledRun) -> float:
    """The mean timed step of the slowest rank (what the breakdown's ``step`` column shows)."""
    return max(r["step_s"] for r in run.reports)


def speedups(runs: Dict[str, ProfiledRun]) -> Dict[str, float]:
    """``{"remedy": x, "good": y}``: the bad run's fastest step over each other's."""
    by_role = {role_of(label): run for label, run in runs.items()}
    missing = [r for r in ROLES if r not in by_role]
    if missing:
        raise ValueError(f"no {' and no '.join(missing)} run among {list(runs)}")
    bad = fastest_step_s(by_role["bad"])
    return {role: bad / fastest_step_s(by_role[role]) for role in ROLES[1:]}


def speedup_line(runs: Dict[str, ProfiledRun]) -> str:
    """``speed-up over the bad configuration: remedy R.RR x, good G.GG x``."""
    s = speedups(runs)
    return (f"speed-up over the bad configuration: remedy {s['remedy']:.2f} x, "
            f"good {s['good']:.2f} x")


def format_steps(runs: Dict[str, ProfiledRun]) -> str:
    """One line per run: its fastest and its mean step (ms), and how many steps were timed."""
    lines = []
    for label, run in runs.items():
        steps = min(len(r["step_seconds"]) for r in run.reports)
        lines.append(f"{label}: fastest step {fastest_step_s(run) * 1e3:.0f} ms, mean "
                     f"{mean_step_s(run) * 1e3:.0f} ms over {steps} timed steps")
    return "\n".join(lines)


def save_runs(runs: Dict[str, ProfiledRun], path) -> str:
    """Write the measured runs as JSON (every field of each :class:`ProfiledRun`), for the
    pictures of lab 15 to be drawn later from the file (:func:`load_runs`). Returns the path."""
    with open(path, "w") as f:
        json.dump({label: dataclasses.asdict(run) for label, run in runs.items()}, f)
    return str(path)


def load_runs(path) -> Dict[str, ProfiledRun]:
    """The runs :func:`save_runs` wrote, as :class:`ProfiledRun` s again (JSON's string keys of
    the per-rank tables turned back into ranks)."""
    with open(path) as f:
        raw = json.load(f)
    runs = {}
    for label, run in raw.items():
        u = run["utilisation"]
        for table in ("values", "cpu_seconds", "pinned"):
            u[table] = {int(rank): v for rank, v in u[table].items()}
        u["window"] = tuple(u["window"]) if u["window"] is not None else None
        runs[label] = ProfiledRun(**dict(run, utilisation=Utilisation(**u)))
    return runs


def schedule_busy_share(tc: TrainConfig) -> float:
    """What the schedule leaves each rank to do, on a device per rank: m/(m + p − 1) for a
    pipeline of p stages fed m micro-batches (1F1B or GPipe, backward included), 1 without a
    pipeline (the data-parallel all-reduce is not in it)."""
    m = tc.global_batch_size // (tc.micro_batch_size * tc.dp)
    return m / (m + tc.pp - 1)


def format_busy_idle(runs: Dict[str, ProfiledRun], configs: Dict[str, TrainConfig]) -> str:
    """Per run and rank, from the rank's own clock: milliseconds busy and idle per timed step,
    the busy share, and the share the schedule predicts (:func:`schedule_busy_share`). Under
    NVML sampling (GPUs), each rank's mean utilisation instead."""
    lines: List[str] = []
    for label, run in runs.items():
        util = run.utilisation
        lines.append(label)
        if util.kind != "clock":
            means = util.mean()
            lines.append("  " + "  ".join(f"rank {r}: {v:3.0f}% ({util.kind})"
                                          for r, v in means.items()))
            continue
        steps = min(len(r["step_seconds"]) for r in run.reports)
        expected = schedule_busy_share(configs[label])
        for b in util.busy():
            core = util.pinned.get(b.rank)
            where = f"core {core}" if core is not None else "not pinned"
            lines.append(f"  rank {b.rank} ({where}): busy {b.busy_s / steps * 1e3:6.0f} ms, "
                         f"idle {b.idle_s / steps * 1e3:6.0f} ms per step; busy share "
                         f"{b.busy_share:.2f} (schedule: {expected:.2f})")
    return "\n".join(lines)



# ---------------------------------------------------------------- predicted for a DGX H100
def predicted_bad_vs_remedy(pipeline_parallel_size: int = WALKTHROUGH_GPUS, microbatches: int = 8,
                            micro_batch_size: int = 1, model: ModelShape = GPT3_1_3B,
                            cluster: Cluster = DGX_H100) -> Dict[str, LogicalTimeline]:
    """``{label: LogicalTimeline}`` of the bad and the remedy pipeline on ``cluster``, one stage
    per GPU, the same ``microbatches × micro_batch_size`` sequences per step: the bad one takes
    them as one micro-batch, the remedy as ``microbatches`` (1F1B,
    :func:`~mpu_lab.perf.pipeline_bubble.predicted_timeline`; times in seconds, the
    point-to-point messages left out). Labels as :func:`bad_vs_good_configs`'s."""
    p, m = pipeline_parallel_size, microbatches
    if p < 2 or model.num_layers % p:
        raise ValueError(f"the pipeline needs at least 2 stages that divide the model's "
                         f"{model.num_layers} layers, got {p}")
    if m < 2 or micro_batch_size < 1:
        raise ValueError(f"the remedy needs at least 2 micro-batches of at least 1 sequence, "
                         f"got {m} of {micro_batch_size}")
    return {f"bad: PP={p}, 1 micro-batch": predicted_timeline(
                model, p, 1, micro_batch_size=m * micro_batch_size, cluster=cluster),
            f"remedy: PP={p}, {m} micro-batches": predicted_timeline(
                model, p, m, micro_batch_size=micro_batch_size, cluster=cluster)}


def predicted_speedup(timelines: Dict[str, LogicalTimeline]) -> float:
    """The bad pipeline's predicted step over the remedy's."""
    by_role = {role_of(label): tl for label, tl in timelines.items()}
    missing = [r for r in ROLES[:2] if r not in by_role]
    if missing:
        raise ValueError(f"no {' and no '.join(missing)} timeline among {list(timelines)}")
    return float(by_role["bad"].makespan) / float(by_role["remedy"].makespan)


def format_predicted(timelines: Dict[str, LogicalTimeline], micro_batch_size: int = 1,
                     model: ModelShape = GPT3_1_3B, cluster: Cluster = DGX_H100) -> str:
    """What :func:`predicted_bad_vs_remedy` predicted (pass it the same ``micro_batch_size``,
    ``model`` and ``cluster``): one line per timeline (the step, each GPU's busy share, the idle
    share), then the predicted speed-up beside the schedule's own ``p·m/(m + p − 1)``."""
    p = next(iter(timelines.values())).pipeline_parallel_size
    m = max(tl.num_microbatches for tl in timelines.values())
    lines = [f"PREDICTED for a {cluster.name} ({model.name}, {m * micro_batch_size} sequences "
             f"of {model.seq_length} tokens per step,", "one pipeline stage per GPU; cost model + "
             "1F1B simulator, point-to-point messages left out):"]
    for label, tl in timelines.items():
        share = tl.bubble_share
        lines.append(f"  {label}: step {float(tl.makespan) * 1e3:6.1f} ms, each GPU busy "
                     f"{1 - share} of it, idle {share}")
    lines.append(f"predicted speed-up of the remedy over the bad configuration: "
                 f"{predicted_speedup(timelines):.2f} x\n  (the schedule alone: p·m/(m+p-1) = "
                 f"{p * m}/{m + p - 1} = {p * m / (m + p - 1):.2f})")
    return "\n".join(lines)


def measured_vs_predicted_line(runs: Dict[str, ProfiledRun], timelines: Dict[str, LogicalTimeline],
                               cluster: Cluster = DGX_H100) -> str:
    """The remedy's speed-up over the bad run, measured here and predicted, side by side."""
    measured = {role_of(label): label for label in runs}
    predicted = {role_of(label): label for label in timelines}
    for name, have in (("measured runs", measured), ("predicted timelines", predicted)):
        if "bad" not in have or "remedy" not in have:
            raise ValueError(f"the {name} need a bad and a remedy entry, got {list(have.values())}")
    return (f"remedy's speed-up over the bad configuration:\n  measured here "
            f"({measured['remedy'].split(': ', 1)[1]}) {speedups(runs)['remedy']:.2f} x\n  "
            f"PREDICTED for a {cluster.name} ({predicted['remedy'].split(': ', 1)[1]}) "
            f"{predicted_speedup(timelines):.2f} x")
