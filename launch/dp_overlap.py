"""Megatron's data parallelism, timed: the small GPT of ``train_gpt.py`` at DP = the number of
ranks, its gradients in buckets of the mirror's ``DistributedDataParallel``, reduced after
backward or during it (``--overlap-grad-reduce``), by an all-reduce or by the distributed
optimizer's reduce-scatter (:mod:`mpu_lab.perf.dp_overlap` runs it and reads the reports).

    torchrun --standalone --nproc-per-node 4 launch/dp_overlap.py --steps 3 \
        --bucket-size 100000 --num-layers 4 --hidden-size 128 --seq-length 128 \
        --micro-batch-size 4 --global-batch-size 16

Flags other than ``--steps``, ``--warmup``, ``--bucket-size``, ``--modes`` and
``--profile-dir`` (lab 15's profiler traces, ``DIR/<mode number>/rank<r>.trace.json``) go to
``train_gpt.py``'s parser (the model and the batch). For each set of flags among the modes
(``dp_overlap.MODES``: all-reduce, distributed optimizer) every rank sets the model up once,
runs the warm-up steps, then the timed steps of its modes, overlap off and on alternating step
by step (one after the other under the profiler). Per step it records, from outside the
mirror, when backward started and ended (hooks on the model's output and on every parameter's
gradient) and (:class:`mpu_lab.perf.comm_timing.CommTimer`) when each bucket's reduction was
issued, done (its future completed) and waited for. Rank 0 prints one line per mode; every
rank reports ``{"rank", "d", "device", "modes": {mode: record}}``.
"""
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from mpu_lab.training import initialize
from mpu_lab import launcher, training
from mpu_lab.perf import dp_overlap
from mpu_lab.perf import rank_clock
from mpu_lab.perf.comm_timing import CommCall, CommTimer
from mpu_lab.perf.breakdown import StepTimer

PRECHECK = "mpu_lab.perf.dp_overlap:check_args"


class Probe:
    """Hooks timing one step's backward on this rank: its start (the gradient reaches the
    model's output) and its end (the last parameter's gradient is accumulated)."""

    def __init__(self, ddp_chunks):
        self.chunks = ddp_chunks
        self.handles = []
        for ddp in ddp_chunks:
            self.handles.append(ddp.module.register_forward_hook(self._on_forward))
            # registered after DDP's own hooks, so they run after them
            self.handles += [p.register_post_accumulate_grad_hook(self._on_grad)
                             for p in ddp.buffer.params]
        self.reset()

    def reset(self):
        self.start: Optional[float] = None
        self.end: Optional[float] = None

    def _on_forward(self, module, inputs, output):
        if torch.is_tensor(output) and output.requires_grad:
            output.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad):
        if self.start is None:
            self.start = time.perf_counter()

    def _on_grad(self, param):
        self.end = time.perf_counter()

    def remove(self):
        for h in self.handles:
            h.remove()


def bucket_of(call: CommCall, chunks) -> Optional[tuple]:
    """``(chunk, bucket index)`` when ``call`` reduced a bucket of a chunk's gradient buffer
    (its tensor is that bucket's slice), else ``None``."""
    for c, ddp in enumerate(chunks):
        for b in ddp.buffer.buckets:
            if call.is_async and call.data_ptr == b.grad_data.data_ptr():
                return c, b.index
    return None


def in_param_buffer(call: CommCall, chunks) -> bool:
    """Whether ``call``'s tensor lies in a chunk's parameter buffer (the distributed
    optimizer's all-gather of the updated parameters)."""
    for ddp in chunks:
        start = ddp.buffer.param_data.data_ptr()
        if start <= call.data_ptr < start + ddp.buffer.param_data.numel() * 4:
            return True
    return False


def step_record(probe: Probe, chunks, calls: List[CommCall], step_s: float) -> dict:
    """One timed step: ``t0_s`` (backward's start, perf_counter: one clock for the ranks of a
    host), then ms from it: backward's end, each bucket's issue / done / waited-for, and the
    exposed communication (last bucket waited for minus backward's end). A bucket started
    during backward when it was issued before backward's last gradient."""
    t0 = probe.start
    ms = lambda t: round(1e3 * (t - t0), 3)  # noqa: E731
    syncs = []
    for call in calls:
        where = bucket_of(call, chunks)
        if where is None:
            continue
        end = call.done_s if call.done_s is not None else time.perf_counter()
        done = min(call.completed_s if call.completed_s is not None else end, end)
        syncs.append(dict(chunk=where[0], bucket=where[1], kind=call.kind, nbytes=call.nbytes,
                          started_in_backward=call.issued_s <= probe.end,
                          start_ms=ms(call.issued_s), done_ms=ms(done), end_ms=ms(end)))
    backward_ms = ms(probe.end)
    last = max((s["end_ms"] for s in syncs), default=backward_ms)
    return dict(t0_s=t0, step_ms=round(1e3 * step_s, 3), backward_ms=backward_ms,
                syncs=sorted(syncs, key=lambda s: s["start_ms"]),
                exposed_ms=round(max(0.0, last - backward_ms), 3))


def volume(calls: List[CommCall], chunks, steps: int) -> List[dict]:
    """The data-parallel payload per step: the gradient buckets' reductions
    (``dp_overlap.GRAD_TAG``) and the all-gathers of the parameter buffer
    (``dp_overlap.PARAM_TAG``), each by kind: calls and bytes of the callers' tensors."""
    table: Dict[tuple, List[float]] = {}
    for call in calls:
        if bucket_of(call, chunks) is not None:
            key = (dp_overlap.GRAD_TAG, call.kind)
        elif call.kind == "all_gather" and in_param_buffer(call, chunks):
            key = (dp_overlap.PARAM_TAG, call.kind)
        else:
            continue
        entry = table.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += call.nbytes
    return [dict(tag=tag, kind=kind, calls=n / steps, bytes=b / steps)
            for (tag, kind), (n, b) in sorted(table.items())]


def schedule(group: List[str], steps: int, interleave: bool) -> List[str]:
    """The order of the timed steps of one set-up model: its modes alternate step by step (a
    paired comparison: a change of load on the machine hits both alike), or run one after the
    other (under the profiler, which one StepTimer at a time can run)."""
    if interleave:
        return [m for _ in range(steps) for m in group]
    return [m for m in group for _ in range(steps)]


def measure(train_argv: Sequence[str], modes: Sequence[str], steps: int, warmup: int = 1,
            profile_dir: Optional[str] = None) -> Dict[str, dict]:
    """Per mode: the buckets, one :func:`step_record` per timed step, the data-parallel
    payload per step (:func:`volume`), and lab 15's StepTimer breakdown."""
    groups: Dict[tuple, List[str]] = {}
    for m in modes:
        groups.setdefault(tuple(dp_overlap.MODES[m][0]), []).append(m)
    out = {}
    for flags, group in groups.items():
        began = time.perf_counter()
        args = training.validate_args(training.parse_args(list(train_argv) + list(flags)),
                                      dist.get_world_size())
        state = training.setup(args, log=lambda s: None)
        for _ in range(warmup):
            training.train_step(state)
        probe = Probe(state.ddp_chunks)
        timers = {m: StepTimer(initialize.get_device(), skip=0, profile_dir=profile_dir and
                               f"{profile_dir}/{list(modes).index(m)}") for m in group}
        calls: Dict[str, List[CommCall]] = {m: [] for m in group}
        records: Dict[str, list] = {m: [] for m in group}
        breakdowns = {}
        order = schedule(group, steps, interleave=profile_dir is None)
        for k, m in enumerate(order):
            for ddp in state.ddp_chunks:
                ddp.overlap_grad_reduce = dp_overlap.MODES[m][1]
            probe.reset()
            with CommTimer() as timer:
                timers[m].time_step(training.train_step, state)
            calls[m] += timer.calls
            records[m].append(step_record(probe, state.ddp_chunks, timer.calls,
                                          timers[m].step_seconds[-1]))
            if m not in order[k + 1:]:        # its last step: stop its profiler, if any
                breakdowns[m] = timers[m].report()
        probe.remove()
        names = {id(p): n for ddp in state.ddp_chunks for n, p in ddp.module.named_parameters()}
        buckets = [dict(row, chunk=c, names=[names[id(p)] for p in b.params])
                   for c, ddp in enumerate(state.ddp_chunks)
                   for row, b in zip(ddp.buffer.table(), ddp.buffer.buckets)]
        for m in group:
            out[m] = dict(mode=m, flags=list(flags), overlap=dp_overlap.MODES[m][1],
                          buckets=buckets, volume=volume(calls[m], state.ddp_chunks, steps),
                          breakdown=breakdowns[m],
                          grad_numel=sum(d.buffer.numel_unpadded for d in state.ddp_chunks),
                          grad_numel_padded=sum(d.buffer.numel for d in state.ddp_chunks),
                          steps=records[m], wall_s=round(time.perf_counter() - began, 3))
    return {m: out[m] for m in modes}


def pin_to_own_core() -> int:
    """On a CPU-only machine: this rank and every thread it starts later (gloo's included) on
    one core of its own, one thread for torch's kernels; returns the core, or -1 where there
    is a GPU or the system cannot pin."""
    if torch.cuda.is_available():
        return -1
    core = rank_clock.core_for(int(os.environ.get("LOCAL_RANK", "0")))
    if not rank_clock.pin_process(os.getpid(), core):
        return -1
    torch.set_num_threads(1)
    return core


@launcher.entrypoint
def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    core = pin_to_own_core() if "--pin" in argv else -1     # before gloo starts its threads
    info = initialize.init()
    a, train_argv = dp_overlap.check_args(argv, info.world_size)
    modes = measure(train_argv, a.modes, a.steps, a.warmup, a.profile_dir)
    for mode, rec in modes.items():
        exposed = sorted(s["exposed_ms"] for s in rec["steps"])[len(rec["steps"]) // 2]
        lines = launcher.gather_lines(f"{exposed:.1f}")
        if lines is not None:
            print(f"{mode}: {len(rec['buckets'])} buckets; exposed communication per rank "
                  f"(ms, median of {a.steps}): {', '.join(lines)}")
    launcher.report({"rank": info.rank, "d": info.world_size, "core": core,
                     "device": str(initialize.get_device()), "modes": modes})
    initialize.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
