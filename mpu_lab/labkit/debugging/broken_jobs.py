"""Lab 17's broken jobs: ``launch/train_gpt.py`` with one fault each (``--inject-fault``,
:mod:`mpu_lab.training.faults`), started in the background a few at a time
(:func:`start_broken_jobs`: they spend most of their time waiting for a collective timeout), and
what each did (:class:`BrokenRun`): the launcher's whole report, and the part of it that stays
the same from run to run (which ranks, which call, where each rank stood), printed apart so a
notebook can compare it.

The playground side (stack dumps, the Flight Recorder, ``TORCH_DISTRIBUTED_DEBUG``) is
:mod:`mpu_lab.labkit.debugging.tools`.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import textwrap
import time
from typing import Dict, List, Optional, Tuple

from mpu_lab import launcher

# --------------------------------------------------------------------------- broken torchrun jobs
# The lab's jobs: a tiny GPT (a few seconds of compute) and one fault each. Two ranks (data
# parallel 2) unless the fault needs other groups; the wrong-group job runs on world_size ranks.
TINY_GPT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "16", "--micro-batch-size", "2", "--vocab-size", "64",
            "--log-interval", "1", "--quiet"]


@dataclasses.dataclass(frozen=True)
class BrokenJob:
    """One broken job of the lab: ``fault`` as given to ``--inject-fault``, its ranks and the
    flags besides :data:`TINY_GPT`."""
    name: str
    fault: str
    nproc: int
    flags: Tuple[str, ...]

    @property
    def args(self) -> List[str]:
        return [*TINY_GPT, *self.flags, "--inject-fault", self.fault]

    @property
    def command(self) -> str:
        return (f"torchrun --nproc-per-node {self.nproc} launch/train_gpt.py "
                + " ".join([*self.flags, "--inject-fault", self.fault]) + " (+ a tiny GPT)")


def lab_jobs(world_size: int) -> Dict[str, BrokenJob]:
    """The lab's broken jobs, by fault kind, in the lab's order."""
    it3 = ("--train-iters", "3", "--global-batch-size", "4")
    return {job.name: job for job in [
        BrokenJob("hang", "hang:1", 2, it3),
        BrokenJob("skip-collective", "skip-collective:1", 2, it3),
        BrokenJob("mismatched-shape", "mismatched-shape:1", 2, it3),
        BrokenJob("wrong-group", "wrong-group:1", world_size,
                  ("--train-iters", "3", "--tensor-model-parallel-size", "2",
                   "--global-batch-size", str(world_size))),
        BrokenJob("crash", "crash:1", 2, it3),
        BrokenJob("pp-deadlock", "pp-deadlock:1", 2,
                  (*it3, "--pipeline-model-parallel-size", "2")),
        BrokenJob("divergence", "divergence:1:3", 2,
                  ("--train-iters", "5", "--global-batch-size", "2",
                   "--tensor-model-parallel-size", "2", "--dense-twin")),
        BrokenJob("fp16-overflow", "fp16-overflow:1:3", 2,
                  ("--train-iters", "5", "--global-batch-size", "4", "--fp16")),
    ]}


# What changes from run to run in a failure's text: gloo's source file, ports, process ids.
# Line numbers too: they move whenever the file is edited (run.show() keeps them).
_VOLATILE = [(re.compile(r"\[/[^\]]*\.(?:cc|cpp|h):\d+\]\s*"), ""),
             (re.compile(r"\[?127\.0\.0\.1\]?:\d+"), "127.0.0.1:PORT"),
             (re.compile(r"\b(pid:?\s*)\d+"), r"\1PID"),
             (re.compile(r"(\.py):\d+ in "), r"\1, in ")]


def _steady(text: str) -> str:
    for pattern, repl in _VOLATILE:
        text = pattern.sub(repl, text)
    return text


# How a rank that waited ended; which of the two a rank sees depends on timing.
_TIMED_OUT = re.compile(r"Timed out waiting|timed out|Timeout\(ms\)|monitoredBarrier", re.I)
_LOST_PEER = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|"
                        r"communicator was aborted|failed to recv|Socket Timeout", re.I)
_RAISED = re.compile(r"^raised at (?P<where>.+?): (?P<message>.*)$", re.S)
_STOPPED_WAITING = re.compile(r"^was stopped at (?P<where>.+?), waiting in \w+$")
_OWN_ERROR = re.compile(r"^Rank (\d+) raised in its own code")


def steady_state(state: str, after: Optional[int] = None) -> str:
    """A rank's state from the launcher (``LaunchError.states``) without what depends on
    timing or on the files' line numbers. A rank that waited in a collective was "stuck
    waiting" at its place: whether gloo told it "timed out" or "connection closed by peer", or
    torchrun stopped it first, depends on which rank's timeout fired first, so the three read
    alike here (``run.error.states`` keeps the launcher's words). With ``after`` (the rank
    whose own error ended the job), any other rank "ended after" it, wherever torchrun's
    SIGTERM found it."""
    if after is not None:
        return f"ended after rank {after} failed (it lost its peer)"
    waiting = _STOPPED_WAITING.match(state)
    if waiting:
        return _steady(f"stuck waiting at {waiting['where']}")
    m = _RAISED.match(state)
    if m is None:
        return _steady(state)
    if _TIMED_OUT.search(m["message"]) or _LOST_PEER.search(m["message"]):
        return _steady(f"stuck waiting at {m['where']}")
    return _steady(f"raised at {m['where']}: {m['message']}")


WIDTH = 100    # the longest line the lab prints


def wrap_lines(text: str, width: int = WIDTH) -> str:
    """``text`` with every line longer than ``width`` broken at spaces, the continuation lines
    indented four spaces past the line's own indent (a path or a message stays readable)."""
    out = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()))
        out += textwrap.wrap(line, width, subsequent_indent=indent + "    ",
                             break_long_words=False, break_on_hyphens=False) or [line]
    return "\n".join(out)


@dataclasses.dataclass
class BrokenRun:
    """What one broken job did: ``error`` (the :class:`~mpu_lab.launcher.LaunchError`) when it
    failed, ``result`` (the :class:`~mpu_lab.launcher.LaunchResult`) when it finished, and how
    long it took when that was measured."""
    job: BrokenJob
    error: Optional[launcher.LaunchError] = None
    result: Optional[launcher.LaunchResult] = None
    elapsed_s: Optional[float] = None

    @property
    def fault(self) -> str:
        return self.job.fault

    @property
    def report(self) -> List[str]:
        """The launcher's message without each rank's traceback (the lines before it)."""
        text = str(self.error) if self.error else ""
        return text.split("Traceback (most recent call last)")[0].rstrip().splitlines()

    def show(self, command: bool = True) -> None:
        """The command (unless ``command`` is False), how it ended and after how long, and the
        launcher's message but its likely cause (timings and ports change from run to run; the
        tracebacks are in ``run.error.traceback``)."""
        if command:
            print(self.job.command)
        after = f" after {self.elapsed_s:.1f} s" if self.elapsed_s is not None else ""
        if self.error is None:
            print(f"finished{after}, exit code 0")
            return
        print(f"{type(self.error).__name__}{after}:")
        print("\n".join(ln for ln in self.report if not ln.lower().startswith("likely cause")))
        print("(the launcher's likely cause: run.likely_cause(); each rank's traceback: "
              "run.error.traceback)")

    @property
    def metrics(self) -> List[dict]:
        """Rank 0's logged metrics of a job that finished."""
        if self.result is None:
            raise RuntimeError(f"the {self.job.name} job did not finish: {self.report[0]}")
        return self.result.results[0]["metrics"]

    def diagnosis(self) -> None:
        """What stays the same from run to run: the launcher's reading of the failure (which
        call, where, which ranks were in it) when it does not depend on which rank failed
        first, then how each rank ended and where it stood (:func:`steady_state`), in rank
        order."""
        if self.error is None:
            print(f"finished: {len(self.result.results)} ranks reported back")
            return
        own = [int(m.group(1)) for m in map(_OWN_ERROR.match, self.report[1:]) if m]
        places = {m["where"] for state in self.error.states.values()
                  for m in (_RAISED.match(state) or _STOPPED_WAITING.match(state),) if m}
        # the launcher's first line names the collective of the rank that failed first: the
        # same every time only when every rank that raised or waited stood at one place
        head = [ln for ln in self.report[1:] if _OWN_ERROR.match(ln)
                or (ln.startswith("A collective") and len(places) == 1)]
        for line in head:
            print(_steady(line))
        if not head and len(places) > 1:
            print(f"The ranks that raised or waited stood at {len(places)} different places:")
        for rank, state in sorted(self.error.states.items()):
            after = own[0] if own and rank != own[0] else None
            print(f"  rank {rank}: {steady_state(state, after)}")

    def likely_cause(self) -> None:
        """The launcher's one-sentence guess at the cause."""
        lines = [_steady(ln) for ln in self.report if "likely cause" in ln.lower()]
        print(wrap_lines("\n".join(lines)) if lines else "(the launcher names no likely cause)")


class BrokenJobs:
    """The lab's broken jobs: those named in ``background`` start now, ``parallel`` at a time
    (they spend most of their time waiting for a timeout); :meth:`result` waits for one.
    Every job's flags are checked here first, one after the other, before any starts; ``env``
    is the environment every job gets (a job run by hand passes it to ``launcher.run``)."""

    def __init__(self, jobs: Dict[str, BrokenJob], background, parallel: int = 2,
                 env: Optional[Dict[str, str]] = None, limit_s: float = 300.0):
        self.jobs, self.env = dict(jobs), dict(env or {})
        unknown = [name for name in background if name not in self.jobs]
        if unknown:
            raise ValueError(f"no broken job {unknown}; the jobs are {list(self.jobs)}")
        for job in self.jobs.values():
            launcher.precheck(launcher.resolve_script("train_gpt.py"), job.args, job.nproc)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, int(parallel)))
        self._futures = {name: self._pool.submit(_run_broken, self.jobs[name], self.env, limit_s)
                         for name in self.jobs if name in background}

    def result(self, name: str) -> BrokenRun:
        """The run of the background job ``name``, once it has ended."""
        if name not in self._futures:
            raise KeyError(f"{name!r} is not running in the background; those are "
                           f"{list(self._futures)}")
        return self._futures[name].result()

    def print_table(self) -> None:
        for name, job in self.jobs.items():
            how = "" if name in self._futures else "  (you start this one yourself)"
            print(f"{name:<17} {job.nproc} ranks  --inject-fault {job.fault:<20} "
                  + " ".join(job.flags) + how)

    def close(self) -> None:
        """Wait for the jobs still running (each ends at its collective timeout)."""
        self._pool.shutdown(wait=True)


def _run_broken(job: BrokenJob, env: Dict[str, str], limit_s: float) -> BrokenRun:
    start = time.monotonic()
    try:
        result = launcher.run("train_gpt.py", job.args, nproc=job.nproc, show="none", env=env,
                              timeout_s=limit_s, check=False)
    except launcher.LaunchError as exc:
        return BrokenRun(job, error=exc, elapsed_s=time.monotonic() - start)
    return BrokenRun(job, result=result, elapsed_s=time.monotonic() - start)


# The lab runs this one itself, in the foreground, to show how any of them is started.
FOREGROUND = ("crash",)
# Jobs the lab leaves out, and why (the lab shows the fault another way).
NOT_RUN = {"fp16-overflow": "the job itself runs in tests/training/test_faults.py (every rank skips the "
                            "step, the scale halves); here the overflowing step runs on the "
                            "playground's ranks, so each rank's scaler can be printed side by side"}


def start_broken_jobs(world_size: int, timeout_s: float, parallel: int = 2,
                      backend: str = "auto") -> BrokenJobs:
    """Start :func:`lab_jobs` but :data:`FOREGROUND` and :data:`NOT_RUN` in the background,
    with ``MPU_LAB_TIMEOUT_S=timeout_s`` (how long a rank waits in a collective) and
    ``MPU_LAB_BACKEND=backend``."""
    env = {"MPU_LAB_TIMEOUT_S": f"{timeout_s:g}", "MPU_LAB_BACKEND": backend}
    jobs = {name: job for name, job in lab_jobs(world_size).items() if name not in NOT_RUN}
    return BrokenJobs(jobs, [n for n in jobs if n not in FOREGROUND], parallel, env)
