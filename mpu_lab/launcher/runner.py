"""Running a ``launch/`` script under ``torchrun`` from a notebook or a script (the lab's own;
Megatron's jobs are started by hand or by Slurm): :func:`run` checks the flags first (each
script's ``PRECHECK``, :mod:`mpu_lab.launcher.prechecks`), starts ``torchrun --standalone``
(its agent forked with torch loaded already, :mod:`mpu_lab.launcher.agent`) with a free
rendezvous port, ``OMP_NUM_THREADS`` and unbuffered output, streams or collates
every line by rank, applies a time limit, returns the ranks' reports as a
:class:`LaunchResult`, and turns a failure into a :class:`LaunchError` naming the root-cause
rank — with the whole process tree stopped and checked gone. :func:`run` reads as its steps:
:func:`check_run_args`, :func:`job_environment`, :func:`follow_job` (:func:`read_lines`),
:func:`print_by_rank`, then :func:`read_results`, or :func:`timeout_error` /
:func:`failure_error`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mpu_lab.launcher import agent
from mpu_lab.launcher.diagnosis import (
    SECONDARY_FAILURE,
    diagnose,
    exit_codes_from_lines,
    first_failed_rank,
    quote_message,
    root_cause,
    traceback_from_lines,
)
from mpu_lab.launcher.paths import LAUNCH_DIR, RESULT_DIR_ENV, job_pythonpath
from mpu_lab.launcher.prechecks import precheck
from mpu_lab.launcher.process_tree import descendants, kill_tree
from mpu_lab.launcher.pump import pump_lines

_MARK = re.compile(r"\[rank(\d+)\]:")


class RankLines:
    """torchrun's output (``--tee``, each line prefixed ``[rankN]:``) split back into each rank's
    lines. torchrun copies a worker's output file as it grows: a line the worker had only half
    written comes out prefixed, without its end, and the next rank's prefix follows on the same
    line (``[rank1]:ab[rank0]:whole line``). :meth:`feed` keeps such a half line until the rest
    of it arrives (``[rank1]:c``) and returns complete ``(rank, text)`` lines; a line with no
    prefix (torchrun's own) has rank ``None``."""

    def __init__(self):
        self._pending: Dict[int, str] = {}

    def feed(self, raw: str) -> List[Tuple[Optional[int], str]]:
        complete = raw.endswith("\n")
        text = raw[:-1] if complete else raw
        marks = list(_MARK.finditer(text))
        out: List[Tuple[Optional[int], str]] = []
        if not marks:
            return [(None, text)] if complete or text else []
        if marks[0].start() > 0:
            out.append((None, text[:marks[0].start()]))
        for i, m in enumerate(marks):
            rank = int(m.group(1))
            end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
            piece = self._pending.pop(rank, "") + text[m.end():end]
            if i + 1 < len(marks) or not complete:
                self._pending[rank] = piece          # a half line: its end comes later
            else:
                out.append((rank, piece))
        return out

    def flush(self) -> List[Tuple[Optional[int], str]]:
        """The half lines still waiting when the job ended, as lines."""
        out = sorted(self._pending.items())
        self._pending.clear()
        return [(rank, text) for rank, text in out]


class LaunchError(RuntimeError):
    """A torchrun job failed. ``rank`` is the root-cause rank (None if unknown)."""

    def __init__(self, message: str, rank: Optional[int] = None, traceback: str = "",
                 returncode: Optional[int] = None, output: Sequence[Tuple[Optional[int], str]] = (),
                 states: Optional[Dict[int, str]] = None):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.returncode = returncode
        self.output = list(output)
        self.states = dict(states or {})   # rank -> what it was doing when the job ended


class LaunchTimeout(LaunchError):
    """The job ran past ``timeout_s`` and was killed."""


@dataclasses.dataclass
class LaunchResult:
    """What a finished job hands back."""
    results: List[Any]                          # per rank, rank order; None where a rank reported nothing
    lines: List[Tuple[Optional[int], str]]      # (rank or None for torchrun itself, text), arrival order
    returncode: int
    elapsed_s: float
    nproc: int
    command: List[str]

    def output(self, rank: int) -> List[str]:
        """The lines one rank printed, in order."""
        return [text for r, text in self.lines if r == rank]

    def collated(self) -> str:
        """Every rank's lines, rank 0 first (deterministic)."""
        out = []
        for r in range(self.nproc):
            out += [f"[rank{r}] {text}" for text in self.output(r)]
        return "\n".join(out)



def max_ranks() -> int:
    """The most ranks :func:`run` starts on this machine (``MPU_LAB_MAX_RANKS`` overrides)."""
    if "MPU_LAB_MAX_RANKS" in os.environ:
        return int(os.environ["MPU_LAB_MAX_RANKS"])
    return max(8, 4 * (os.cpu_count() or 1))


def resolve_script(script) -> pathlib.Path:
    """A path as given, or a name under the repository's ``launch/`` folder."""
    path = pathlib.Path(script)
    for candidate in (path, LAUNCH_DIR / path, LAUNCH_DIR / f"{path}.py"):
        if candidate.is_file():
            return candidate.resolve()
    scripts = sorted(p.name for p in LAUNCH_DIR.glob("*.py"))
    raise FileNotFoundError(f"no launch script {str(script)!r}; the launch/ folder has {scripts}")


def torchrun_command(script: pathlib.Path, args: Sequence[str], nproc: int, log_dir: str,
                     python: str = sys.executable) -> List[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--tee=3", f"--log-dir={log_dir}", str(script), *map(str, args)]


def run(script, args: Sequence[str] = (), nproc: int = 2, timeout_s: float = 600.0,
        show: str = "live", env: Optional[Dict[str, str]] = None, cwd=None,
        python: str = sys.executable,
        on_line: Optional[Callable[[Optional[int], str], None]] = None,
        check: bool = True) -> LaunchResult:
    """Run ``script`` with ``nproc`` ranks under torchrun; return the ranks' reports.

    ``show``: ``"live"`` prints each line as it arrives (``[rank3] ...``), ``"ranks"`` prints
    all lines after the job grouped in rank order, ``"none"`` prints nothing.
    ``env`` adds environment variables (e.g. ``{"MPU_LAB_TIMEOUT_S": "20"}``).
    ``on_line(rank, text)`` is called, in this thread, for each line as it arrives (rank
    ``None`` for torchrun's own lines): e.g. to redraw a live view while the job runs.
    ``check``: for a script that declares a ``PRECHECK`` (``train_gpt.py``, ``rank_groups.py``),
    check the flags for ``nproc`` ranks here first — a ``ValueError`` before any process starts
    (:func:`precheck`).
    Raises :class:`LaunchError` (root-cause rank and traceback) or :class:`LaunchTimeout`.
    """
    check_run_args(nproc, show, timeout_s)
    if isinstance(args, str):
        args = args.split()
    path = resolve_script(script)
    if check:
        precheck(path, args, nproc, cwd=cwd)

    for attempt in range(1, CONNECT_ATTEMPTS + 1):
        try:
            result = run_once(path, args, nproc, timeout_s, show, env, cwd, python, on_line)
        except LaunchError as exc:
            if attempt < CONNECT_ATTEMPTS and ranks_could_not_connect(exc):
                print(f"[launcher] {path.name}: the ranks could not connect to each other "
                      f"(gloo's connectFullMesh failed, which happens on a loaded machine); "
                      f"starting the job once more", file=sys.stderr, flush=True)
                continue
            if show == "ranks":
                print_by_rank(exc.output, nproc)
            raise
        if show == "ranks":
            print_by_rank(result.lines, nproc)
        return result
    raise AssertionError("unreachable")


# A job whose ranks failed to connect while setting up a gloo group (each pair of ranks opens
# a TCP connection; on a loaded machine a peer can close one before the handshake completes)
# is started once more: the same failure is gloo's own transient, which its own connection
# retries (gloo PR 413) reduce but do not remove. Any other failure is the job's and is raised.
CONNECT_ATTEMPTS = 2
_GLOO_CONNECT = re.compile(r"connectFullMesh failed")


def ranks_could_not_connect(exc: "LaunchError") -> bool:
    """True when ``exc`` is a job that failed because its ranks could not connect (gloo)."""
    return bool(_GLOO_CONNECT.search(str(exc)))


def run_once(path: pathlib.Path, args: Sequence[str], nproc: int, timeout_s: float, show: str,
             env: Optional[Dict[str, str]], cwd, python: str,
             on_line: Optional[Callable[[Optional[int], str], None]]) -> LaunchResult:
    """One torchrun job of :func:`run` (its flags already checked); lines printed live when
    ``show="live"``, the rank-ordered print left to :func:`run`."""
    work = pathlib.Path(tempfile.mkdtemp(prefix="mpu_lab_run_"))
    try:
        result_dir, log_dir = work / "results", work / "logs"
        result_dir.mkdir()
        child_env = job_environment(nproc, result_dir, env)
        command = torchrun_command(path, args, nproc, str(log_dir), python)
        start = time.monotonic()
        proc = agent.start(command, child_env, cwd)
        lines, timed_out = follow_job(proc, timeout_s, start, show, on_line)
        elapsed = time.monotonic() - start
        if timed_out:
            raise timeout_error(path.name, timeout_s, nproc, lines, result_dir, proc.returncode)
        if proc.returncode != 0:
            raise failure_error(path.name, proc.returncode, nproc, lines, log_dir, result_dir,
                                child_env.get("MPU_LAB_TIMEOUT_S"))
        return LaunchResult(read_results(result_dir, nproc), lines, proc.returncode, elapsed,
                            nproc, command)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------- run's steps
def check_run_args(nproc, show: str, timeout_s: float) -> None:
    """Raise ``ValueError`` for a bad ``nproc``, ``show`` or ``timeout_s`` of :func:`run`."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    if nproc > max_ranks():
        raise ValueError(
            f"nproc={nproc} ranks requested, but this machine ({os.cpu_count()} cores) starts at "
            f"most {max_ranks()}; use nproc <= {max_ranks()} (or set MPU_LAB_MAX_RANKS)"
        )
    if show not in ("live", "ranks", "none"):
        raise ValueError(f"show must be 'live', 'ranks' or 'none', got {show!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")


def job_environment(nproc: int, result_dir: pathlib.Path,
                    env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """This process's environment plus what the job needs: unbuffered output, threads per rank,
    where ranks report, torchrun's rank prefix, this checkout on the path; then ``env``."""
    child_env = dict(os.environ)
    threads = child_env.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    child_env.update({
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": threads,
        RESULT_DIR_ENV: str(result_dir),
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:",
        "PYTHONPATH": job_pythonpath(child_env.get("PYTHONPATH")),
    })
    child_env.update({k: str(v) for k, v in (env or {}).items()})
    return child_env


def follow_job(proc: "subprocess.Popen | agent.AgentProcess", timeout_s: float, start: float,
               show: str, on_line: Optional[Callable[[Optional[int], str], None]]
               ) -> Tuple[List[Tuple[Optional[int], str]], bool]:
    """Read the job's output by rank until it ends or ``timeout_s`` (from ``start``) is up;
    return its ``(rank, text)`` lines and whether it timed out. However this ends (a time
    limit, ``KeyboardInterrupt`` from the notebook's stop button), no process of the job is
    left behind."""
    lines: List[Tuple[Optional[int], str]] = []
    timed_out = False
    try:
        ended = read_lines(pump_lines(proc.stdout), RankLines(), lines, timeout_s, start, show,
                           on_line)
        timed_out = not ended
        if ended:
            proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        timed_out = True
    except BaseException:
        kill_tree(proc)
        raise
    finally:
        if timed_out:
            kill_tree(proc)
        # Workers run in sessions of their own: make sure none outlives the job.
        if descendants(proc.pid) or proc.poll() is None:
            kill_tree(proc)
    return lines, timed_out


def read_lines(incoming: "queue.Queue[Optional[str]]", splitter: RankLines,
               lines: List[Tuple[Optional[int], str]], timeout_s: float, start: float,
               show: str, on_line) -> bool:
    """Append each complete ``(rank, text)`` line to ``lines`` as it arrives, printing it
    (``show="live"``) and passing it to ``on_line``. True when the output ended, False when
    ``timeout_s`` ran out first."""
    while True:
        remaining = timeout_s - (time.monotonic() - start)
        if remaining <= 0:
            return False
        try:
            raw = incoming.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            continue
        for rank, text in splitter.flush() if raw is None else splitter.feed(raw):
            lines.append((rank, text))
            if show == "live":
                print(f"[rank{rank}] {text}" if rank is not None else text, flush=True)
            if on_line is not None:
                on_line(rank, text)
        if raw is None:
            return True


def print_by_rank(lines: Sequence[Tuple[Optional[int], str]], nproc: int) -> None:
    """Every rank's lines, rank 0 first (``show="ranks"``)."""
    for r in range(nproc):
        for text in (t for rr, t in lines if rr == r):
            print(f"[rank{r}] {text}")


def read_results(result_dir: pathlib.Path, nproc: int) -> List[Any]:
    """What each rank passed to :func:`~mpu_lab.launcher.worker.report`, rank order."""
    results = []
    for r in range(nproc):
        f = result_dir / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    return results


def timeout_error(name: str, timeout_s: float, nproc: int,
                  lines: Sequence[Tuple[Optional[int], str]], result_dir: pathlib.Path,
                  returncode: Optional[int]) -> LaunchTimeout:
    """The error of a job killed at its time limit: where each rank was, the last lines."""
    tail = "\n".join(f"[rank{r}] {t}" if r is not None else t for r, t in lines[-20:])
    _, states = diagnose(result_dir, nproc, "", "", None)
    where = "\n".join(f"  rank {r} {s}" for r, s in sorted(states.items()))
    return LaunchTimeout(
        f"{name}: the job ran past timeout_s={timeout_s:g} s and was killed "
        f"(all {nproc} ranks). Where the ranks were:\n{where}\nLast lines:\n{tail}",
        returncode=returncode, output=lines, states=states)


def failure_error(name: str, returncode: int, nproc: int,
                  lines: Sequence[Tuple[Optional[int], str]], log_dir: pathlib.Path,
                  result_dir: pathlib.Path, timeout_env: Optional[str]) -> LaunchError:
    """The error of a job that exited non-zero: the root-cause rank, its message and traceback,
    and the diagnosis of where every rank was."""
    rank, message, tb = root_cause(log_dir, result_dir)
    if rank is None:
        rank = first_failed_rank(lines)
    tail = ""
    if not tb and rank is not None:
        tail = traceback_from_lines(lines, rank)
        if tail.startswith("Traceback"):
            tb, tail = tail, ""
        elif not message:
            # No exception anywhere: the rank torchrun listed ended by a signal or an exit
            # code, and may be one torchrun stopped because another aborted. The diagnosis
            # (stack dumps, exit codes) says who; its last lines are only context.
            rank = None
    head = f"{name} failed: rank {rank} raised first" if rank is not None \
        else f"{name} failed (exit code {returncode}); no rank raised a Python exception"
    codes = exit_codes_from_lines(lines)
    if not message or SECONDARY_FAILURE.search(message):
        silent = rank_that_exited_silently(name, lines, codes, result_dir)
        if silent is not None:
            rank, tb, head = silent
    detail = quote_message(message) if message else ""
    diagnosis, states = diagnose(result_dir, nproc, message, tb, timeout_env, codes)
    return LaunchError(f"{head}{': ' + detail if detail else ''}\n"
                       f"{diagnosis + chr(10) if diagnosis else ''}{tb or tail}".rstrip(),
                       rank=rank, traceback=tb, returncode=returncode, output=lines,
                       states=states)


def rank_that_exited_silently(name: str, lines: Sequence[Tuple[Optional[int], str]],
                              codes: Dict[int, int], result_dir: pathlib.Path
                              ) -> Optional[Tuple[int, str, str]]:
    """``(rank, traceback, head)`` of the first rank that exited with a code of its own and
    left no exception record, or None.

    Called when no rank raised, or only echoes of a dead peer were raised: the root cause is
    then a rank that exited by itself (os._exit, sys.exit) while the others ended by
    torchrun's signal (negative codes). Which rank torchrun happened to list first, or what a
    rank last printed, says nothing then, so neither is presented as the error."""
    silent = [r for r, c in sorted(codes.items()) if c > 0 and not
              (result_dir / f"failed_rank{r}.json").exists()]
    if not silent:
        return None
    rank = silent[0]
    tb = traceback_from_lines(lines, rank)
    tb = tb if tb.startswith("Traceback") else ""
    head = (f"{name} failed: rank {rank} exited with code {codes[rank]} "
            f"without a Python exception; the others lost their peer")
    return rank, tb, head
