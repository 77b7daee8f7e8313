"""Megatron's data parallelism from a real run: the gradient buckets, each bucket's reduction
starting during backward (``--overlap-grad-reduce``) or after it, and the data-parallel bytes.

What lab 04 calls (one torchrun job of ``launch/dp_overlap.py``)::

    result = run_dp_overlap(nproc=4, num_layers=4, hidden_size=128)
    print(format_buckets(result))          # the buffer's buckets, last layer first
    print(format_overlap_table(result))    # backward and exposed communication, per rank
    print(format_volume_table(result))     # bytes per step: counted vs formula
    print(format_saving(result))           # step and exposed communication, overlap off / on
    viz.plot_dp_timeline(result)           # mpu_lab.labkit.data_parallel.viz
    # run_dp_overlap(..., profile=True): lab 15's traces of the same steps
    viz.plot_kernel_timeline(kernel_timelines(result))

The job trains the small GPT of ``train_gpt.py`` at DP = ``nproc`` with the mirror's
:class:`~mpu_lab.core.distributed.DistributedDataParallel` (buckets of ``bucket_size`` elements) in
each of :data:`MODES`: the all-reduce, the distributed optimizer's reduce-scatter, each with and
without overlap (overlap off and on alternate step by step on one set-up model, so a change of
load on the machine hits both alike). Per rank and timed step it records when backward started and ended (hooks on
the model's output and on every parameter's gradient) and, from a
:class:`~mpu_lab.perf.comm_timing.CommTimer` (at ``mpu_lab.core.comm``'s hook point), when each
bucket's reduction was issued, when it was done, and when ``finish_grad_sync`` had waited for
it. **Exposed communication** is the time from the end of backward until the last bucket was
waited for: what the step pays for data parallelism on top of its compute.

**CPU and GPU.** Here (gloo, ranks sharing a few cores) a bucket's reduction runs on gloo's own
thread, which competes with backward for the same cores, and it cannot finish before the
slowest rank has issued it too: overlap hides what the cores would otherwise spend waiting, not
the transfer itself. With NCCL on GPUs the reduction runs on its own CUDA stream over
NVLink / InfiniBand while backward's kernels keep the compute units busy, so the exposed part
shrinks towards the reduction of the last bucket (the first layers' gradients): why gradients
are bucketed at all (Li et al. 2020 §3.2, https://arxiv.org/abs/2006.15704).

**The volume formula.** A ring collective over ``d`` ranks of a ``G``-byte buffer makes each
rank send (nccl-tests' PERFORMANCE.md, the "bus bandwidth" factors,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md; ZeRO §7,
https://arxiv.org/abs/1910.02054):

* all-reduce: ``2 (d - 1) / d * G`` (a reduce-scatter, then an all-gather);
* reduce-scatter: ``(d - 1) / d * G``; all-gather: ``(d - 1) / d * G``.

So the distributed optimizer (reduce-scatter of the gradients, all-gather of the updated
parameters) moves exactly what the all-reduce does. The job counts each call's input
payload: ``G`` for the all-reduce and the reduce-scatter, ``G / d`` (a rank's shard) for the
all-gather; :func:`ring_bytes_sent` turns a counted payload into the bytes a rank sends.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from typing import Dict, List, Optional, Sequence

from mpu_lab import launcher, training
from mpu_lab.perf import kernel_timeline
from mpu_lab.perf.cost_model import dp_overlap as overlap_model

# name -> (train_gpt.py flags, overlap on). Without either flag train_gpt.py uses torch DDP, so
# "all-reduce" is built with --overlap-grad-reduce and the wrapper's overlap_grad_reduce off.
MODES = {"all-reduce": (["--overlap-grad-reduce"], False),
         "all-reduce + overlap": (["--overlap-grad-reduce"], True),
         "distributed optimizer": (["--use-distributed-optimizer"], False),
         "distributed optimizer + overlap": (["--use-distributed-optimizer",
                                             "--overlap-grad-reduce"], True)}
GRAD_TAG, PARAM_TAG = "grads.data_parallel", "params.data_parallel"
DEFAULT_MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128,
                     micro_batch_size=4, vocab_size=512)
DEFAULT_BUCKET_SIZE = 100_000


def ring_bytes_sent(kind: str, counted_bytes: float, d: int) -> float:
    """Bytes one rank sends in a ring ``kind`` over ``d`` ranks, from the payload
    the job counts (the rank's input): all-reduce ``2 (d-1)/d`` of it, reduce-scatter
    ``(d-1)/d`` of it, all-gather ``(d-1)`` times it (its input is one shard, ``G / d``)."""
    if d < 1:
        raise ValueError(f"d must be >= 1 ranks, got {d}")
    factors = {"all_reduce": 2 * (d - 1) / d, "reduce_scatter": (d - 1) / d,
               "all_gather": float(d - 1)}
    if kind not in factors:
        raise ValueError(f"no ring formula for {kind!r}; known: {sorted(factors)}")
    return factors[kind] * counted_bytes


# ------------------------------------------------------------------ the script's flags
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Megatron's DDP buckets and overlap, timed; any "
                                "other flag goes to train_gpt.py's parser (the model)",
                                allow_abbrev=False)
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first, per mode")
    p.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE,
                   help="elements per gradient bucket (--ddp-bucket-size)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, of: {', '.join(MODES)}")
    p.add_argument("--pin", action="store_true",
                   help="on a CPU: pin each rank (all its threads) to a core of its own, one "
                        "thread: the timing then shows what a device per rank would")
    p.add_argument("--profile-dir", default=None,
                   help="also run the timed steps under torch.profiler (lab 15's traces): "
                        "DIR/<mode number>/rank<r>.trace.json")
    return p


def check_args(argv: Sequence[str], world_size: int, cwd=None):
    """The script's ``PRECHECK``: ``(own flags, train_gpt.py argv)``, or a ``ValueError``
    naming bad values; the model's flags go through train_gpt.py's ``check_launch_args``."""
    a, rest = parser().parse_known_args([str(v) for v in argv])
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [f"--{n} {v} must be >= {lo}" for n, v, lo in
           (("steps", a.steps, 1), ("warmup", a.warmup, 0), ("bucket-size", a.bucket_size, 1))
           if v < lo]
    bad += [f"unknown mode {m!r} (known: {', '.join(MODES)})" for m in modes if m not in MODES]
    if not modes or len(set(modes)) < len(modes):
        bad.append(f"--modes must name each mode once, got {modes}")
    if world_size < 2:
        bad.append(f"{world_size} rank: data parallelism needs at least 2")
    if bad:
        raise ValueError("dp_overlap.py: " + "; ".join(bad))
    a.modes = modes
    train_argv = rest + ["--ddp-bucket-size", str(a.bucket_size), "--quiet"]
    for m in modes:
        training.check_launch_args(train_argv + MODES[m][0], world_size, cwd=cwd)
    return a, train_argv


# ------------------------------------------------------------------ the driver's side
@dataclasses.dataclass
class DPOverlapResult:
    """What :func:`run_dp_overlap` returns: ``reports`` per rank (rank order), each
    ``{"rank", "d", "device", "modes": {mode: record}}`` (``launch/dp_overlap.py``'s
    ``measure``: ``buckets``, ``steps`` (one record per timed step, ms from its backward's
    start), ``volume``, lab 15's StepTimer ``breakdown``)."""
    d: int
    modes: List[str]
    bucket_size: int
    train_argv: List[str]
    reports: List[dict]
    wall_s: float

    @property
    def device(self) -> str:
        return self.reports[0]["device"]

    def mode(self, name: str) -> List[dict]:
        """Every rank's record of mode ``name``, rank order."""
        if name not in self.modes:
            raise KeyError(f"mode {name!r} was not run; run: {self.modes}")
        return [r["modes"][name] for r in self.reports]


def _flag_list(model: Dict[str, object]) -> List[str]:
    out = []
    for key, value in model.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value not in (False, None):
            out += [flag, str(value)]
    return out


def run_dp_overlap(nproc: int = 4, steps: int = 3, bucket_size: int = DEFAULT_BUCKET_SIZE,
                   modes: Sequence[str] = tuple(MODES), warmup: int = 1, profile: bool = False,
                   show: str = "none", timeout_s: float = 300.0, pin: bool = False,
                   env: Optional[Dict[str, str]] = None, **model_kwargs) -> DPOverlapResult:
    """Run ``launch/dp_overlap.py`` at DP = ``nproc`` (ONE torchrun job, every mode in it).
    ``model_kwargs``: train_gpt.py's flags as keywords (``num_layers=4``, ``hidden_size=128``,
    ...) over :data:`DEFAULT_MODEL`. ``profile``: also record lab 15's profiler traces (for
    :func:`kernel_timelines`; slower). ``pin``: on a CPU, each rank on a core of its own with one
    thread (use at most as many ranks as :func:`mpu_lab.perf.rank_clock.usable_cores`). Bad values raise ``ValueError`` before anything starts."""
    model = {**DEFAULT_MODEL, **model_kwargs}
    model.setdefault("global_batch_size", model["micro_batch_size"] * nproc)
    argv = _flag_list(model) + ["--steps", steps, "--warmup", warmup,
                                "--bucket-size", bucket_size, "--modes", ",".join(modes)]
    if profile:
        argv += ["--profile-dir", tempfile.mkdtemp(prefix="dp_overlap_traces_")]
    if pin:
        argv.append("--pin")
    start = time.perf_counter()
    job = launcher.run("dp_overlap.py", [str(a) for a in argv], nproc=nproc, show=show,
                       timeout_s=timeout_s, env=env)
    return DPOverlapResult(d=nproc, modes=list(modes), bucket_size=bucket_size,
                           train_argv=_flag_list(model), reports=list(job.results),
                           wall_s=time.perf_counter() - start)


# ------------------------------------------------------------------ tables
def kernel_timelines(result: DPOverlapResult, bin_ms: float = 5.0) -> Dict[str, list]:
    """Lab 15's view of the same steps (``run_dp_overlap(..., profile=True)``): per mode, each
    rank's compute / communication / idle from its trace, for ``viz.plot_kernel_timeline``."""
    if "profile" not in result.mode(result.modes[0])[0]["breakdown"]:
        raise ValueError("no profiler traces in this result: run run_dp_overlap(..., "
                         "profile=True)")
    return {m: kernel_timeline.kernel_timelines([r["breakdown"] for r in result.mode(m)], bin_ms)
            for m in result.modes}


def _median(rec: dict, key: str) -> float:
    return statistics.median(s[key] for s in rec["steps"])


def exposed_ms(result: DPOverlapResult, mode: str) -> List[float]:
    """Per rank, the median over the timed steps of the exposed communication (ms)."""
    return [_median(r, "exposed_ms") for r in result.mode(mode)]


def _dp_wait_ms(rec: dict) -> float:
    """ms per step lab 15's StepTimer booked to data-parallel calls and waits."""
    return 1e3 * sum(v for k, v in rec["breakdown"]["parts"].items() if k.startswith("dp "))


def overlap_saving(result: DPOverlapResult) -> List[dict]:
    """For each mode run with and without overlap: the step (median over steps, mean over
    ranks) and the exposed communication (likewise), both ways, and the share saved."""
    mean = lambda m, k: statistics.fmean(_median(r, k) for r in result.mode(m))  # noqa: E731
    rows = [dict(mode=m, step_ms=mean(m, "step_ms"),
                 step_overlap_ms=mean(f"{m} + overlap", "step_ms"),
                 exposed_ms=mean(m, "exposed_ms"),
                 exposed_overlap_ms=mean(f"{m} + overlap", "exposed_ms"))
            for m in result.modes if f"{m} + overlap" in result.modes]
    for r in rows:
        r["saved_pct"] = 100 * (1 - r["step_overlap_ms"] / r["step_ms"])
    return rows


def format_saving(result: DPOverlapResult) -> str:
    """One line per mode pair: step and exposed communication without and with overlap."""
    return "\n".join(
        f"{r['mode']}: step {r['step_ms']:.0f} ms -> {r['step_overlap_ms']:.0f} ms with overlap "
        f"({r['saved_pct']:+.0f} % saved); exposed communication {r['exposed_ms']:.0f} ms -> "
        f"{r['exposed_overlap_ms']:.0f} ms (mean of {result.d} ranks, {result.device})"
        for r in overlap_saving(result))


def format_buckets(result: DPOverlapResult, mode: Optional[str] = None) -> str:
    """The gradient buffer's buckets (rank 0; every rank has the same), first reduced first."""
    rec = result.mode(mode or result.modes[0])[0]
    lines = [f"{'bucket':>6} {'params':>6} {'elements':>9} {'padded':>8}  first .. last parameter"]
    for b in rec["buckets"]:
        lines.append(f"{b['bucket']:>6} {b['params']:>6} {b['numel']:>9} {b['padded']:>8}  "
                     f"{b['names'][0]} ..")
        lines.append(f"{'':>33}.. {b['names'][-1]}")
    lines.append(f"{len(rec['buckets'])} buckets of about {result.bucket_size} elements;")
    lines.append(f"{rec['grad_numel']} gradient elements ({rec['grad_numel_padded']} padded to "
                 f"multiples of d = {result.d})")
    return "\n".join(lines)


def format_overlap_table(result: DPOverlapResult) -> str:
    """Per mode and rank: median step, backward, exposed communication (ms), ``dp wait``
    (lab 15's StepTimer: data-parallel calls and waits per step, the distributed optimizer's
    all-gather included), and how many bucket reductions started during backward."""
    lines = [f"{'mode':<31} {'rank':>4} {'step ms':>8} {'backward ms':>11} "
             f"{'exposed comm ms':>15} {'dp wait ms':>10} {'started in backward':>19}"]
    for mode in result.modes:
        for rank, (rec, exp) in enumerate(zip(result.mode(mode), exposed_ms(result, mode))):
            last = rec["steps"][-1]["syncs"]
            started = sum(s["started_in_backward"] for s in last)
            lines.append(f"{mode:<31} {rank:>4} {_median(rec, 'step_ms'):8.1f} "
                         f"{_median(rec, 'backward_ms'):11.1f} {exp:15.1f} "
                         f"{_dp_wait_ms(rec):10.1f} {f'{started} of {len(last)}':>19}")
    lines.append(f"(median of {len(result.mode(result.modes[0])[0]['steps'])} steps, "
                 f"d = {result.d}, {result.device})")
    return "\n".join(lines)


def volume_rows(result: DPOverlapResult) -> List[dict]:
    """Per mode and data-parallel collective (rank 0's count; all ranks send the same):
    calls and payload per step as the job's CommTimer counted them, and the bytes a rank sends
    by the ring formula (:func:`ring_bytes_sent`)."""
    rows = []
    for mode in result.modes:
        rec = result.mode(mode)[0]
        for v in rec["volume"]:
            rows.append(dict(mode=mode, tag=v["tag"], kind=v["kind"], calls=v["calls"],
                             counted_bytes=v["bytes"],
                             sent_bytes=ring_bytes_sent(v["kind"], v["bytes"], result.d)))
    return rows


def format_volume_table(result: DPOverlapResult) -> str:
    """The data-parallel bytes per step and rank: counted payload, bytes sent by the ring
    formula, and the total against ``2 (d-1)/d`` x the gradient buffer."""
    d = result.d
    rec = result.mode(result.modes[0])[0]
    g = 4 * rec["grad_numel_padded"]
    lines = [f"gradient buffer: {rec['grad_numel_padded']} fp32 elements = {g / 1e6:.3f} MB; "
             f"d = {d}; 2(d-1)/d x buffer = {2 * (d - 1) / d * g / 1e6:.3f} MB",
             f"{'mode':<31} {'collective':<36} {'calls':>5} {'counted MB':>10} {'sent MB':>8}"]
    totals: Dict[str, float] = {}
    for row in volume_rows(result):
        what = f"{row['kind']} ({row['tag']})"
        lines.append(f"{row['mode']:<31} {what:<36} {row['calls']:5.0f} "
                     f"{row['counted_bytes'] / 1e6:10.3f} {row['sent_bytes'] / 1e6:8.3f}")
        totals[row["mode"]] = totals.get(row["mode"], 0.0) + row["sent_bytes"]
    lines += [f"{mode:<31} {'total sent per rank':<36} {'':>16} {sent / 1e6:8.3f}"
              for mode, sent in totals.items()]
    return "\n".join(lines)


# ------------------------------------------------------------------ the bucket-size sweep
def sweep_rows(results: Dict[int, DPOverlapResult]) -> List[dict]:
    """``{bucket size: run_dp_overlap(...) with the two all-reduce modes}`` -> one row per
    size: buckets, the measured exposed communication without and with overlap (median over
    steps, mean over ranks, s), and the overlap model's (:mod:`mpu_lab.perf.cost_model.dp_overlap`)
    for the same buckets, with this machine's channel fitted to the runs without overlap and
    the measured backward."""
    rows = []
    for size, result in sorted(results.items()):
        rec = result.mode("all-reduce")[0]
        mean = lambda m, k: statistics.fmean(_median(r, k) for r in result.mode(m)) / 1e3  # noqa: E731
        rows.append(dict(bucket_numel=size, buckets=len(rec["buckets"]),
                         bucket_bytes=[4.0 * b["padded"] for b in rec["buckets"]],
                         bytes=4.0 * rec["grad_numel_padded"], d=result.d,
                         backward_s=mean("all-reduce", "backward_ms"),
                         exposed_off_s=mean("all-reduce", "exposed_ms"),
                         exposed_on_s=mean("all-reduce + overlap", "exposed_ms")))
    channel = overlap_model.fit_channel(rows, rows[0]["d"]) if len(rows) > 1 else None
    for r in rows:
        r["model_on_s"] = None if channel is None else overlap_model.bucket_timeline(
            r["bucket_bytes"], r["backward_s"], r["d"], channel["alpha_s"], channel["busbw"],
            overlap=True).exposed_s
        r["channel"] = channel
    return rows


def format_sweep(rows: Sequence[dict]) -> str:
    """The sweep as a table (ms), and the channel fitted to it."""
    lines = [f"{'bucket (elements)':>18} {'buckets':>8} {'backward':>9} {'exposed: no overlap':>20}"
             f" {'overlap':>8} {'model, overlap':>15}"]
    for r in rows:
        model = "-" if r["model_on_s"] is None else f"{1e3 * r['model_on_s']:.1f}"
        lines.append(f"{r['bucket_numel']:>18,} {r['buckets']:>8} {1e3 * r['backward_s']:>9.1f}"
                     f" {1e3 * r['exposed_off_s']:>20.1f} {1e3 * r['exposed_on_s']:>8.1f}"
                     f" {model:>15}")
    channel = rows[0]["channel"] if rows else None
    if channel:
        above = sum(r["exposed_on_s"] > r["model_on_s"] for r in rows)
        lines.append(f"measured with overlap above the model at {above} of {len(rows)} sizes")
        bw = "too fast to show" if channel["busbw"] == float("inf") else \
            f"{channel['busbw'] / 1e9:.2f} GB/s"
        lines.append(f"(ms, d = {rows[0]['d']}; the model's channel, fitted to the runs without "
                     f"overlap:\n alpha {1e6 * channel['alpha_s']:.0f} us per ring step, bus "
                     f"bandwidth {bw})")
    return "\n".join(lines)
