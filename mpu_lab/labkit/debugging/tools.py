"""Lab 17's tools on a live playground world, each printed deterministically:

* :func:`dump_hung_stacks` — a stack dump of every rank of a hung world (``faulthandler`` on a
  signal: what ``kill -USR1 PID`` gives a job that registered it, or ``py-spy dump --pid PID``
  any Python process);
* :func:`flight_recorder_demo` — the Flight Recorder's record of each rank's collectives
  (``TORCH_FR_BUFFER_SIZE``; NCCL's older name ``TORCH_NCCL_TRACE_BUFFER_SIZE``), which shows
  the collective one rank never issued;
* :func:`detail_demo` — ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s check of every collective's
  fingerprint (operation, shapes) across the ranks, on a collective with mismatched shapes;
* :func:`overflow_demo` — an fp16 overflow on one rank, and how the dynamic loss scaler makes
  every rank skip the step.

The torchrun side (the lab's broken ``train_gpt.py`` jobs and their diagnosis) is
:mod:`mpu_lab.labkit.debugging.broken_jobs`.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import pathlib
import pickle
import re
import shutil
import signal
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from mpu_lab.core import comm, parallel_state
from mpu_lab.training import initialize
from mpu_lab.training.arguments import parse_args
from mpu_lab.launcher.diagnosis import repo_relative
from mpu_lab.launcher.worker import FAULTHANDLER_FRAME, THREAD_HEADING

STACK_SIGNAL = signal.SIGUSR1
FR_BUFFER = "TORCH_FR_BUFFER_SIZE"   # the Flight Recorder's ring buffer (NCCL's older name:
                                     # TORCH_NCCL_TRACE_BUFFER_SIZE); 0 or unset: off
_ENGINE_FILE = os.path.join("playground", "engine.py")
_STACK_FILES: Dict[int, Any] = {}   # engine side: the open file faulthandler writes into


# --------------------------------------------------------------------------- engine side
def _register_stack_dump(directory: str) -> int:
    """Runs inside a rank: on ``STACK_SIGNAL``, write this process's Python stack to
    ``directory/stack_rank<r>.txt`` (the file stays open: faulthandler writes from its signal
    handler, even while the main thread is blocked inside a C++ collective)."""
    rank = dist.get_rank()
    old = _STACK_FILES.pop(rank, None)
    if old is not None:
        old.close()
    f = open(pathlib.Path(directory) / f"stack_rank{rank}.txt", "w")
    _STACK_FILES[rank] = f
    # every thread: the signal may land on any of the engine's threads (zmq, heartbeat);
    # format_stack keeps the one that runs the cell
    faulthandler.register(STACK_SIGNAL, file=f, all_threads=True, chain=False)
    return os.getpid()


def _unregister_stack_dump() -> None:
    faulthandler.unregister(STACK_SIGNAL)
    for f in _STACK_FILES.values():
        f.close()
    _STACK_FILES.clear()


def _side_group(timeout_s: float):
    """Runs inside a rank (every rank calls it): a new gloo group of the whole world with its
    own short timeout, so a demonstration that times out leaves the world's groups usable
    (gloo on any machine: these tensors stay on the CPU)."""
    return dist.new_group(list(range(dist.get_world_size())), backend="gloo",
                          timeout=datetime.timedelta(seconds=timeout_s))


def stuck_step(late_rank: int, seconds: float, timeout_s: float) -> str:
    """Runs inside a rank: one step of a broken job. ``late_rank`` sleeps (in its own code)
    where the others wait in the step's all-reduce, until their timeout."""
    group, x = _side_group(timeout_s), torch.ones(1)     # cpu: a gloo side group
    if dist.get_rank() == late_rank:
        time.sleep(seconds)                       # the bug: this rank is somewhere else
        return "woke up after the others had timed out"
    try:
        dist.all_reduce(x, group=group)
    except RuntimeError:
        return "timed out"
    return "finished"


def _skipping_steps(skipper: int, timeout_s: float) -> List[Dict[str, Any]]:
    """Runs inside a rank: three collectives, the third one skipped by ``skipper``; then this
    rank's Flight Recorder entries since the call (what the ring buffer holds), whatever
    happened."""
    os.environ.setdefault(FR_BUFFER, "64")        # read when a group is made
    seen = max((e["record_id"] for e in _recorded()), default=-1)
    group, x = _side_group(timeout_s), torch.ones(4)     # cpu: a gloo side group
    try:
        dist.all_reduce(x, group=group)
        dist.broadcast(x, src=0, group=group)
        if dist.get_rank() != skipper:            # the bug: a rank-dependent `if`
            dist.all_reduce(x, group=group)
    except RuntimeError:
        pass                                      # the timeout: the recorder says why
    keep = ("collective_seq_id", "profiling_name", "input_sizes")
    return [{k: e.get(k) for k in keep} for e in _recorded()
            if e["record_id"] > seen and e["collective_seq_id"] > 0]


def _recorded() -> List[Dict[str, Any]]:
    """Runs inside a rank: the Flight Recorder's entries (every process group this process
    has had, oldest first; empty when ``TORCH_FR_BUFFER_SIZE`` was not set)."""
    # without the stack traces: symbolising them takes seconds per dump
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False))
    return list(dump.get("entries", []))


def _detail_mismatch(odd_rank: int) -> str:
    """Runs inside a rank: a process group made under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (the
    debug level the group is made with decides whether it is wrapped), then an all-reduce on
    it of 1 element, 2 on ``odd_rank``. Returns the error (or "finished"). The wrapper checks
    the ranks' calls before the real collective runs, so the world's own groups are untouched."""
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        group = _side_group(60.0)
    finally:
        dist.set_debug_level(level)
    x = torch.ones(2 if dist.get_rank() == odd_rank else 1)   # cpu: a gloo side group
    try:
        dist.all_reduce(x, group=group)
    except RuntimeError as exc:
        return str(exc)
    return "finished"


def _overflow_steps(bad_rank: int, factor: float, steps: int) -> List[Dict[str, Any]]:
    """Runs inside a rank: ``steps`` fp16 backwards of a tiny layer with the loss scale of a
    :class:`~mpu_lab.core.optimizer.DynamicGradScaler` built as ``train_gpt.py`` builds it,
    ``factor`` times larger on ``bad_rank``; each time the gradient averaged over the
    data-parallel group (what DDP does), then the scaler's overflow check agreed over the
    model-parallel group and its update, as ``train_gpt.py`` does after every backward."""
    from mpu_lab.training.setup import build_grad_scaler   # the model's modules: on the rank
    device = initialize.get_device()
    scaler = build_grad_scaler(parse_args(["--fp16"]))      # train_gpt.py --fp16's defaults
    rows = []
    for _ in range(steps):
        before = scaler.scale
        weight = torch.ones(4, 4, dtype=torch.float16, device=device, requires_grad=True)
        x = torch.ones(2, 4, dtype=torch.float16, device=device)
        scale = scaler.scale * (factor if dist.get_rank() == bad_rank else 1.0)
        ((x @ weight).float().mean() * scale).backward()
        own = not bool(weight.grad.isfinite().all())
        weight.grad = comm.all_reduce(weight.grad, group=parallel_state.get_data_parallel_group())
        after_dp = not bool(weight.grad.isfinite().all())
        skipped = scaler.unscale_and_check([weight], parallel_state.get_model_parallel_group())
        scaler.update(skipped)
        rows.append(dict(own=own, after_dp=after_dp, skipped=skipped, before=before,
                         after=scaler.scale))
    return rows


# --------------------------------------------------------------------------- notebook side
def _frames(text: str) -> List[Tuple[str, int, str]]:
    """``(file, line, function)`` of the thread of a faulthandler dump that runs the cell (the
    one that passes through the engine's runner), innermost first, down to that runner (the
    ipyparallel frames below it are the same on every rank)."""
    blocks = THREAD_HEADING.split(text)
    cell = [b for b in blocks if _ENGINE_FILE in b]
    out = []
    for m in FAULTHANDLER_FRAME.finditer(cell[0] if cell else text):
        if m["file"].endswith(_ENGINE_FILE):
            break
        out.append((m["file"], int(m["line"]), m["func"]))
    return out


def _short(path: str) -> str:
    """A frame's file as a reader finds it: in this repository, or inside torch (no line
    numbers there: they change with the torch version). An installed package is never the
    repository's, even where the virtual environment sits inside it (the README's ``.venv``)."""
    own = repo_relative(path)
    if own:
        return own
    p = pathlib.Path(path)
    if "torch" in p.parts:
        return "/".join(p.parts[p.parts.index("torch"):])
    return p.name


def format_stack(text: str) -> List[str]:
    """A faulthandler dump as lines ``function  (file:line)``, innermost first; torch's own
    frames without their line numbers."""
    lines = []
    for path, line, func in _frames(text):
        where = _short(path)
        where += "" if where.startswith("torch/") else f":{line}"
        lines.append(f"{func:<20} ({where})")
    return lines


def dump_hung_stacks(world, late_rank: int = 1, timeout_s: float = 2.0,
                     settle_s: float = 0.5) -> Dict[int, List[str]]:
    """Hang ``world`` on purpose (:func:`stuck_step`: ``late_rank`` sleeps while the others
    wait in an all-reduce of a group with a ``timeout_s`` timeout), and while it hangs send
    every rank's process ``STACK_SIGNAL``: each writes its Python stack (``faulthandler``).
    Prints each rank's stack, innermost frame first, in rank order. Returns
    ``{rank: stack lines}``."""
    directory = tempfile.mkdtemp(prefix="mpu_lab_stacks_")
    try:
        pids = world.run(_register_stack_dump, directory)
        step = threading.Thread(target=world.run, args=(stuck_step, late_rank,
                                                        timeout_s + settle_s, timeout_s))
        step.start()
        time.sleep(settle_s)                      # every rank is now where it hangs
        for pid in pids:
            os.kill(pid, STACK_SIGNAL)
        time.sleep(0.2)
        stacks = {r: format_stack((pathlib.Path(directory) / f"stack_rank{r}.txt").read_text())
                  for r in range(world.world_size)}
        step.join()
    finally:
        world.run(_unregister_stack_dump)
        shutil.rmtree(directory, ignore_errors=True)
    for rank, lines in stacks.items():
        print(f"rank {rank} (innermost frame first):")
        for line in lines:
            print(f"    {line}")
    return stacks


def flight_recorder_demo(world, skipper: int = 1,
                         timeout_s: float = 2.0) -> Dict[int, List[Dict[str, Any]]]:
    """On every rank of ``world``, with ``TORCH_FR_BUFFER_SIZE`` set (64 unless the rank has a
    value) before a group with a ``timeout_s`` timeout is made: an all-reduce, a broadcast and a second all-reduce that
    ``skipper`` skips; after the timeout, each rank's Flight Recorder entries. Prints them (one
    line per rank: the collectives it issued, by sequence number), then which ranks lack the
    last one. Returns ``{rank: entries}``."""
    entries = dict(enumerate(world.run(_skipping_steps, skipper, timeout_s)))
    if not any(entries.values()):
        print(f"The Flight Recorder recorded nothing: the ranks' {FR_BUFFER} is 0.")
        return entries
    for rank, rows in entries.items():
        calls = ", ".join(f"#{e['collective_seq_id']} {e['profiling_name']} "
                          f"{e['input_sizes'][0] if e['input_sizes'] else []}" for e in rows)
        print(f"rank {rank}: {calls}")
    last = max(e["collective_seq_id"] for rows in entries.values() for e in rows)
    have = [r for r, rows in entries.items() if any(e["collective_seq_id"] == last for e in rows)]
    lack = [r for r in entries if r not in have]
    name = next(e["profiling_name"] for rows in entries.values() for e in rows
                if e["collective_seq_id"] == last)
    print(f"collective #{last} ({name}) was issued by ranks {have}; ranks {lack} never "
          f"issued it.")
    return entries


_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\((.*?)\)\)?"
                          r"[,.]", re.S)
_ASPECT = re.compile(r"Op type|Tensor shapes|Tensor dtypes|Tensor devices|Sequence number")
_FIELD = re.compile(r"(OpType|TensorShape)=(\[[^\]]*\]|\w+)")


def fingerprint_report(message: str) -> str:
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s mismatch error as one line: each rank's operation
    with its tensor's shape, ``ALLREDUCE([2])``, and the aspects it names (``Tensor shapes``,
    ``Op type``...)."""
    if "Detected mismatch between collectives" not in message:
        return message.splitlines()[0] if message else ""
    parts = []
    for rank, body in _FINGERPRINT.findall(message):
        fields = dict(_FIELD.findall(body))
        parts.append(f"rank {rank} runs {fields.get('OpType', '?')}"
                     f"({fields.get('TensorShape', '?')})")
    differ = message.split("Collectives differ in the following aspects:")[-1]
    aspects = sorted(set(_ASPECT.findall(differ)))
    return "; ".join(parts) + (f" (they differ in: {', '.join(aspects)})" if aspects else "")


def detail_demo(world, odd_rank: int = 1) -> List[str]:
    """On every rank of ``world``: a group made under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, and on
    it an all-reduce whose tensor has 2 elements on ``odd_rank`` and 1 elsewhere. Prints every
    rank's error as :func:`fingerprint_report` reads it, in rank order; returns the lines."""
    lines = [f"rank {r}: {fingerprint_report(text)}"
             for r, text in enumerate(world.run(_detail_mismatch, odd_rank))]
    print("\n".join(lines))
    return lines


def overflow_demo(world, bad_rank: int = 1, factor: float = 2.0 ** 64,
                  steps: int = 2) -> List[List[Dict[str, Any]]]:
    """``steps`` fp16 steps in a row on every rank of ``world``, in each of which
    ``bad_rank``'s loss scale is ``factor`` times too large (:func:`_overflow_steps`). Prints,
    per step and rank, whether its own gradient overflowed, whether it did after the
    data-parallel all-reduce, whether the model-parallel group agreed to skip the step, and
    the loss scale before and after. Returns each rank's rows."""
    per_rank = world.run(_overflow_steps, bad_rank, factor, steps)
    print("step  rank  inf in its own gradient  inf after the DP all-reduce  step skipped  "
          "loss scale")
    for step in range(steps):
        for rank, rows in enumerate(per_rank):
            row = rows[step]
            print(f"{step + 1:>4}  {rank:>4}  {row['own']!s:<24}  {row['after_dp']!s:<27}  "
                  f"{row['skipped']!s:<12}  {row['before']:g} -> {row['after']:g}")
    return per_rank


def py_spy() -> Optional[str]:
    """The path of ``py-spy`` if it is installed here (``py-spy dump --pid PID`` prints a
    running process's Python stack with no code in that process), else None."""
    return shutil.which("py-spy")
