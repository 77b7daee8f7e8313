"""Megatron's data parallelism from a real run: the gradient buckets, each bucket's reduction
starting during backward (``--overlap-grad-reduce``) or after it, and the data-parallel bytes.

What lab 10 calls (one torchrun job of ``launch/dp_overlap.py``)::

    result = run_dp_overlap(nproc=4, num_layers=4, hidden_size=128)
    print(format_buckets(result))          # the buffer's buckets, last layer first
    print(format_overlap_table(result))    # backward and exposed communication, per rank
    print(format_volume_table(result))     # bytes per step: counted by mpu_lab.comm vs formula
    viz.plot_dp_timeline(result)           # mpu_lab.labkit.viz.dp_overlap

The job trains the small GPT of ``train_gpt.py`` at DP = ``nproc`` with the mirror's
:class:`~mpu_lab.distributed.DistributedDataParallel` (buckets of ``bucket_size`` elements) in
each of :data:`MODES`: the all-reduce, the distributed optimizer's reduce-scatter, each with and
without overlap. Per rank and timed step it records when backward started and ended (hooks on
the model's output and on every parameter's gradient) and, from ``ddp.sync_log``, when each
bucket's reduction was issued, when it was done, and when ``finish_grad_sync`` had waited for
it. **Exposed communication** is the time from the end of backward until the last bucket was
waited for: what the step pays for data parallelism on top of its compute.

**The volume formula.** A ring collective over ``d`` ranks of a ``G``-byte buffer makes each
rank send (nccl-tests' PERFORMANCE.md, the "bus bandwidth" factors,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md; ZeRO §7,
https://arxiv.org/abs/1910.02054):

* all-reduce: ``2 (d - 1) / d * G`` (a reduce-scatter, then an all-gather);
* reduce-scatter: ``(d - 1) / d * G``; all-gather: ``(d - 1) / d * G``.

So the distributed optimizer (reduce-scatter of the gradients, all-gather of the updated
parameters) moves exactly what the all-reduce does. ``mpu_lab.comm`` counts each call's input
payload: ``G`` for the all-reduce and the reduce-scatter, ``G / d`` (a rank's shard) for the
all-gather; :func:`ring_bytes_sent` turns a counted payload into the bytes a rank sends.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from mpu_lab import comm, distributed, launcher, training
from mpu_lab.timers import StepTimer

# name -> (train_gpt.py flags, overlap on). "all-reduce" has no flag of its own: without either
# flag train_gpt.py uses torch DDP, so it is built with --overlap-grad-reduce and the wrapper's
# ``overlap_grad_reduce`` (what the flag sets) is switched off: the same buckets, no overlap.
MODES = {"all-reduce": (["--overlap-grad-reduce"], False),
         "all-reduce + overlap": (["--overlap-grad-reduce"], True),
         "distributed optimizer": (["--use-distributed-optimizer"], False),
         "distributed optimizer + overlap": (["--use-distributed-optimizer",
                                             "--overlap-grad-reduce"], True)}
GRAD_TAG, PARAM_TAG = "grads.data_parallel", "params.data_parallel"
# The model run_dp_overlap trains unless told otherwise (train_gpt.py's flags).
DEFAULT_MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128,
                     micro_batch_size=4, vocab_size=512)
DEFAULT_BUCKET_SIZE = 100_000


def ring_bytes_sent(kind: str, counted_bytes: float, d: int) -> float:
    """Bytes one rank sends in a ring ``kind`` over ``d`` ranks, from the payload
    ``mpu_lab.comm`` counts (the rank's input): all-reduce ``2 (d-1)/d`` of it, reduce-scatter
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
                                "other flag goes to train_gpt.py's parser (the model)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first, per mode")
    p.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE,
                   help="elements per gradient bucket (--ddp-bucket-size)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, of: {', '.join(MODES)}")
    return p


def check_args(argv: Sequence[str], world_size: int, cwd=None):
    """The script's ``PRECHECK``: ``(own flags, train_gpt.py argv of the first mode)``; a
    ``ValueError`` naming the values for bad ones, before any process starts. The model's
    flags are checked by train_gpt.py's own :func:`~mpu_lab.training.check_launch_args`."""
    a, rest = parser().parse_known_args([str(v) for v in argv])
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [f"--{n} {v} must be >= {lo}" for n, v, lo in
           (("steps", a.steps, 1), ("warmup", a.warmup, 0), ("bucket-size", a.bucket_size, 1))
           if v < lo]
    bad += [f"unknown mode {m!r} (known: {', '.join(MODES)})" for m in modes if m not in MODES]
    if not modes:
        bad.append("--modes names no mode")
    if world_size < 2:
        bad.append(f"{world_size} rank: data parallelism needs at least 2")
    if bad:
        raise ValueError("dp_overlap.py: " + "; ".join(bad))
    a.modes = modes
    train_argv = rest + ["--ddp-bucket-size", str(a.bucket_size), "--quiet"]
    for m in modes:
        training.check_launch_args(train_argv + MODES[m][0], world_size, cwd=cwd)
    return a, train_argv


# ------------------------------------------------------------------ inside a rank
class _Probe:
    """Hooks timing one step's backward on this rank: its start (the gradient reaches the
    model's output), its end (the last parameter's gradient is accumulated), and when each
    bucket reduction started during backward was done (its future's completion)."""

    def __init__(self, ddp_chunks):
        self.chunks = ddp_chunks
        self.handles = []
        for ddp in ddp_chunks:
            self.handles.append(ddp.module.register_forward_hook(self._on_forward))
            # registered after DDP's own hooks, so they run after it (a bucket it started
            # is already in ddp._pending)
            self.handles += [p.register_post_accumulate_grad_hook(self._on_grad)
                             for p in ddp.buffer.params]
        self.reset()

    def reset(self):
        self.start: Optional[float] = None
        self.end: Optional[float] = None
        self.done: Dict[tuple, float] = {}
        self._watched = set()

    def _on_forward(self, module, inputs, output):
        if torch.is_tensor(output) and output.requires_grad:
            output.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad):
        if self.start is None:
            self.start = time.perf_counter()

    def _on_grad(self, param):
        self.end = time.perf_counter()
        # The mirror's Pending keeps torch's Work as ``_work``: its future says when the
        # transfer itself finished (wait() only says when someone asked).
        for c, ddp in enumerate(self.chunks):
            for index, pending in list(getattr(ddp, "_pending", {}).items()):
                key = (c, index)
                work = getattr(pending, "_work", None)
                if key in self._watched or work is None or not hasattr(work, "get_future"):
                    continue
                self._watched.add(key)
                work.get_future().add_done_callback(
                    lambda _f, key=key: self.done.setdefault(key, time.perf_counter()))

    def remove(self):
        for h in self.handles:
            h.remove()


def _step_record(probe: _Probe, chunks, step_s: float) -> dict:
    t0 = probe.start
    ms = lambda t: round(1e3 * (t - t0), 3)  # noqa: E731
    syncs = []
    for c, ddp in enumerate(chunks):
        for e in ddp.sync_log:
            done = probe.done.get((c, e["bucket"]), e["end_s"])
            syncs.append(dict(chunk=c, bucket=e["bucket"], kind=e["kind"], nbytes=e["nbytes"],
                              started_in_backward=e["started_in_backward"],
                              start_ms=ms(e["start_s"]), done_ms=ms(min(done, e["end_s"])),
                              end_ms=ms(e["end_s"])))
    backward_ms = ms(probe.end)
    last = max((s["end_ms"] for s in syncs), default=backward_ms)
    return dict(t0_s=t0, step_ms=round(1e3 * step_s, 3), backward_ms=backward_ms,
                syncs=sorted(syncs, key=lambda s: s["start_ms"]),
                exposed_ms=round(max(0.0, last - backward_ms), 3))


def measure(train_argv: Sequence[str], mode: str, steps: int, warmup: int = 1) -> dict:
    """Run inside every rank: set up ``train_gpt.py``'s GPT with ``train_argv`` plus the mode's
    flags, ``warmup`` untimed steps, then ``steps`` steps timed by lab 08's
    :class:`~mpu_lab.timers.StepTimer` with their collectives counted. Returns the buckets,
    one record per step (times in ms from that step's backward start), the counted
    data-parallel payload per step, and the StepTimer's breakdown."""
    flags, overlap = MODES[mode]
    began = time.perf_counter()
    args = training.validate_args(training.parse_args(list(train_argv) + flags),
                                  dist.get_world_size())
    state = training.setup(args, log=lambda s: None)
    for ddp in state.ddp_chunks:
        ddp.overlap_grad_reduce = overlap
    for _ in range(warmup):
        training.train_step(state)
    probe = _Probe(state.ddp_chunks)
    timer = StepTimer(distributed.get_device(), skip=0)
    records = []
    with comm.CommCounter() as counter:
        for _ in range(steps):
            probe.reset()
            timer.time_step(training.train_step, state)
            records.append(_step_record(probe, state.ddp_chunks, timer.step_seconds[-1]))
    probe.remove()
    names = {id(p): n for ddp in state.ddp_chunks for n, p in ddp.module.named_parameters()}
    buckets = [dict(row, chunk=c, names=[names[id(p)] for p in b.params],
                    param_numels=[p.numel() for p in b.params])
               for c, ddp in enumerate(state.ddp_chunks)
               for row, b in zip(ddp.buffer.table(), ddp.buffer.buckets)]
    volume = [dict(tag=tag, kind=kind, calls=n / steps, bytes=b / steps)
              for (tag, kind), (n, b) in sorted(counter.summary().items(), key=str)
              if tag in (GRAD_TAG, PARAM_TAG)]
    return dict(mode=mode, flags=flags, overlap=overlap, buckets=buckets,
                grad_numel=sum(d.buffer.numel_unpadded for d in state.ddp_chunks),
                grad_numel_padded=sum(d.buffer.numel for d in state.ddp_chunks),
                steps=records, volume=volume, breakdown=timer.report(),
                wall_s=round(time.perf_counter() - began, 3))


# ------------------------------------------------------------------ the driver's side
@dataclasses.dataclass
class DPOverlapResult:
    """What :func:`run_dp_overlap` returns: ``reports`` per rank (rank order), each
    ``{"rank", "d", "device", "modes": {mode: measure(...)}}``."""
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
                   modes: Sequence[str] = tuple(MODES), warmup: int = 1, show: str = "none",
                   timeout_s: float = 300.0, env: Optional[Dict[str, str]] = None,
                   **model_kwargs) -> DPOverlapResult:
    """Run ``launch/dp_overlap.py`` at DP = ``nproc`` (ONE torchrun job, every mode in it).
    ``model_kwargs``: train_gpt.py's flags as keywords (``num_layers=4``, ``hidden_size=128``,
    ...) over :data:`DEFAULT_MODEL`. Bad values raise ``ValueError`` before anything starts."""
    model = {**DEFAULT_MODEL, **model_kwargs}
    model.setdefault("global_batch_size", model["micro_batch_size"] * nproc)
    argv = _flag_list(model) + ["--steps", steps, "--warmup", warmup,
                                "--bucket-size", bucket_size, "--modes", ",".join(modes)]
    start = time.perf_counter()
    job = launcher.run("dp_overlap.py", [str(a) for a in argv], nproc=nproc, show=show,
                       timeout_s=timeout_s, env=env)
    return DPOverlapResult(d=nproc, modes=list(modes), bucket_size=bucket_size,
                           train_argv=_flag_list(model), reports=list(job.results),
                           wall_s=time.perf_counter() - start)


# ------------------------------------------------------------------ tables
def exposed_ms(result: DPOverlapResult, mode: str) -> List[float]:
    """Per rank, the median over the timed steps of the exposed communication (ms)."""
    return [statistics.median(s["exposed_ms"] for s in r["steps"]) for r in result.mode(mode)]


def format_buckets(result: DPOverlapResult, mode: Optional[str] = None) -> str:
    """The gradient buffer's buckets (rank 0; every rank has the same), first reduced first."""
    rec = result.mode(mode or result.modes[0])[0]
    lines = [f"{'bucket':>6} {'params':>6} {'elements':>9} {'padded':>8}  first .. last parameter"]
    for b in rec["buckets"]:
        lines.append(f"{b['bucket']:>6} {b['params']:>6} {b['numel']:>9} {b['padded']:>8}  "
                     f"{b['names'][0]} .. {b['names'][-1]}")
    lines.append(f"{len(rec['buckets'])} buckets of about {result.bucket_size} elements; "
                 f"{rec['grad_numel']} gradient elements ({rec['grad_numel_padded']} padded to "
                 f"multiples of d = {result.d})")
    return "\n".join(lines)


def format_overlap_table(result: DPOverlapResult) -> str:
    """Per mode and rank: median step, backward, exposed communication (ms), and how many
    bucket reductions started during backward."""
    lines = [f"{'mode':<31} {'rank':>4} {'step ms':>8} {'backward ms':>11} "
             f"{'exposed comm ms':>15} {'started in backward':>19}"]
    for mode in result.modes:
        for rank, (rec, exp) in enumerate(zip(result.mode(mode), exposed_ms(result, mode))):
            med = lambda k: statistics.median(s[k] for s in rec["steps"])  # noqa: E731
            last = rec["steps"][-1]["syncs"]
            started = sum(s["started_in_backward"] for s in last)
            lines.append(f"{mode:<31} {rank:>4} {med('step_ms'):8.1f} {med('backward_ms'):11.1f} "
                         f"{exp:15.1f} {f'{started} of {len(last)}':>19}")
    lines.append(f"(median of {len(result.mode(result.modes[0])[0]['steps'])} steps, "
                 f"d = {result.d}, {result.device})")
    return "\n".join(lines)


def volume_rows(result: DPOverlapResult) -> List[dict]:
    """Per mode and data-parallel collective (rank 0's count; all ranks send the same):
    calls and payload per step as ``mpu_lab.comm`` counted them, and the bytes a rank sends
    by the ring formula (:func:`ring_bytes_sent`)."""
    rows = []
    for mode in result.modes:
        rec = result.mode(mode)[0]
        for v in rec["volume"]:
            rows.append(dict(mode=mode, tag=v["tag"], kind=v["kind"], calls=v["calls"],
                             counted_bytes=v["bytes"],
                             sent_bytes=ring_bytes_sent(v["kind"], v["bytes"], result.d),
                             grad_bytes=4 * rec["grad_numel"]))
    return rows


def format_volume_table(result: DPOverlapResult) -> str:
    """The data-parallel bytes per step and rank: counted payload, bytes sent by the ring
    formula, and the total against ``2 (d-1)/d`` x the gradient buffer."""
    d = result.d
    rec = result.mode(result.modes[0])[0]
    g = 4 * rec["grad_numel_padded"]
    lines = [f"gradient buffer: {rec['grad_numel_padded']} fp32 elements = {g / 1e6:.3f} MB; "
             f"d = {d}; 2(d-1)/d x buffer = {2 * (d - 1) / d * g / 1e6:.3f} MB",
             f"{'mode':<31} {'collective':<34} {'calls':>5} {'counted MB':>10} {'sent MB':>8}"]
    totals: Dict[str, float] = {}
    for row in volume_rows(result):
        what = f"{row['kind']} ({row['tag']})"
        lines.append(f"{row['mode']:<31} {what:<34} {row['calls']:5.0f} "
                     f"{row['counted_bytes'] / 1e6:10.3f} {row['sent_bytes'] / 1e6:8.3f}")
        totals[row["mode"]] = totals.get(row["mode"], 0.0) + row["sent_bytes"]
    for mode, sent in totals.items():
        lines.append(f"{mode:<31} {'total sent per rank':<34} {'':>5} {'':>10} "
                     f"{sent / 1e6:8.3f}")
    return "\n".join(lines)
