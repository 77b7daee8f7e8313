"""Running a ``launch/`` script under ``torchrun`` from a notebook or a script (the lab's own;
Megatron's jobs are started by hand or by Slurm): :func:`run` checks the flags first (each
script's ``PRECHECK``, :func:`precheck`), starts ``torchrun --standalone`` with a free
rendezvous port, ``OMP_NUM_THREADS`` and unbuffered output, streams or collates every line by
rank, applies a time limit, returns the ranks' reports as a :class:`LaunchResult`, and turns a
failure into a :class:`LaunchError` naming the root-cause rank — with the whole process tree
stopped and checked gone.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import io
import json
import os
import pathlib
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mpu_lab.launcher.diagnosis import (
    _SECONDARY,
    _diagnose,
    _exit_codes,
    _first_failed_rank,
    _root_cause,
    _traceback_from_lines,
)
from mpu_lab.launcher.paths import LAUNCH_DIR, REPO_ROOT, RESULT_DIR_ENV
from mpu_lab.launcher.process_tree import _alive, descendants, kill_tree

_MARK = re.compile(r"\[rank(\d+)\]:")
# Two launches at once (threads) both read their script's PRECHECK with ast.parse, which in
# CPython 3.11 can fail with "AST constructor recursion depth mismatch" when run concurrently.
_PARSE_LOCK = threading.Lock()
# sys.stdout and sys.stderr are process-wide: two pre-checks redirecting them from two threads
# at once (jobs launched side by side) could restore them in the wrong order and leave the
# notebook's stdout pointing at a dead buffer, so one pre-check runs at a time
_REDIRECT_LOCK = threading.Lock()


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


# --------------------------------------------------------------------------- pre-checks
def precheck_spec(path) -> Optional[str]:
    """The ``PRECHECK`` string a script declares at module level (``"module:function"``), read
    from its source with :mod:`ast` — the script is not imported — or None."""
    try:
        with _PARSE_LOCK:    # CPython 3.11's parser is not safe in two threads at once
            tree = ast.parse(pathlib.Path(path).read_text(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "PRECHECK" for t in targets):
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
            raise ValueError(f"{pathlib.Path(path).name}: PRECHECK must be a string literal "
                             f"'package.module:function', got {ast.dump(value)}")
    return None


def resolve_precheck(spec: str) -> Callable[..., Any]:
    """The function a ``PRECHECK`` string names: ``"package.module:function"``, imported with
    :func:`importlib.import_module` — a plugin-style lookup, so the launcher itself imports no
    training code; each script names the check of its own flags."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"PRECHECK {spec!r} is not of the form 'package.module:function'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def script_prechecks(directory=LAUNCH_DIR) -> Dict[str, Callable[..., Any]]:
    """``{script name: check}`` for the scripts of ``directory`` that declare a ``PRECHECK``;
    each check is resolved when it is called (``check(argv, nproc, cwd=None)``)."""
    out: Dict[str, Callable[..., Any]] = {}
    for path in sorted(pathlib.Path(directory).glob("*.py")):
        spec = precheck_spec(path)
        if spec:
            out[path.name] = functools.partial(_call_precheck, spec)
    return out


def _call_precheck(spec: str, argv: Sequence[str], nproc: int, cwd=None):
    return resolve_precheck(spec)(argv, nproc, cwd=cwd)


def precheck(path: pathlib.Path, args: Sequence[str], nproc: int, cwd=None) -> None:
    """Run the pure flag check that the script ``path`` declares for ``nproc`` ranks.

    Each script owns its pre-check: it declares at module level, e.g.
    ``PRECHECK = "mpu_lab.training.arguments:check_launch_args"``; the launcher reads that
    string from the source (:func:`precheck_spec`, no import of the script), resolves it
    (:func:`resolve_precheck`) and calls it as ``fn(argv, nproc, cwd=cwd)`` in this process,
    before torchrun starts (no ``torch.distributed``), so a configuration that cannot work
    fails in well under a second with a ``ValueError`` naming the numbers. An argparse error
    becomes a ``ValueError`` with argparse's message; ``--help`` is left to the job."""
    spec = precheck_spec(path)
    if spec is None:
        return
    check = resolve_precheck(spec)
    err = io.StringIO()
    try:
        with _REDIRECT_LOCK, contextlib.redirect_stderr(err), \
                contextlib.redirect_stdout(io.StringIO()):
            check([str(a) for a in args], nproc, cwd=cwd)
    except SystemExit as exc:
        if exc.code in (0, None):
            return
        raise ValueError(f"{path.name}: bad arguments {list(map(str, args))}: "
                         f"{err.getvalue().strip().splitlines()[-1] if err.getvalue() else exc}"
                         ) from None



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
    if isinstance(args, str):
        args = args.split()
    path = resolve_script(script)
    if check:
        precheck(path, args, nproc, cwd=cwd)

    work = pathlib.Path(tempfile.mkdtemp(prefix="mpu_lab_run_"))
    result_dir, log_dir = work / "results", work / "logs"
    result_dir.mkdir()
    child_env = dict(os.environ)
    child_env.update({
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": child_env.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc)),
        RESULT_DIR_ENV: str(result_dir),
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), child_env.get("PYTHONPATH")) if p),
    })
    child_env.update({k: str(v) for k, v in (env or {}).items()})
    command = torchrun_command(path, args, nproc, str(log_dir), python)

    lines: List[Tuple[Optional[int], str]] = []
    splitter = RankLines()
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, env=child_env, cwd=cwd, start_new_session=True)
    q: "queue.Queue[Optional[str]]" = queue.Queue()

    def pump():
        for raw in proc.stdout:
            q.put(raw)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    timed_out = False
    try:
        done = False
        while not done:
            remaining = timeout_s - (time.monotonic() - start)
            if remaining <= 0:
                timed_out = True
                break
            try:
                raw = q.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            got = splitter.flush() if raw is None else splitter.feed(raw)
            for rank, text in got:
                lines.append((rank, text))
                if show == "live":
                    print(f"[rank{rank}] {text}" if rank is not None else text, flush=True)
                if on_line is not None:
                    on_line(rank, text)
            if raw is None:
                done = True
                break
        if not timed_out:
            proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        timed_out = True
    except BaseException:  # KeyboardInterrupt from the notebook's stop button included
        kill_tree(proc)
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        if timed_out:
            kill_tree(proc)
        # Workers run in sessions of their own: make sure none outlives the job.
        leftovers = [p for p in descendants(proc.pid) if _alive(p)]
        if leftovers or proc.poll() is None:
            kill_tree(proc)
    elapsed = time.monotonic() - start

    if show == "ranks":
        for r in range(nproc):
            for text in (t for rr, t in lines if rr == r):
                print(f"[rank{r}] {text}")
    try:
        if timed_out:
            tail = "\n".join(f"[rank{r}] {t}" if r is not None else t for r, t in lines[-20:])
            _, states = _diagnose(result_dir, nproc, "", "", None)
            where = "\n".join(f"  rank {r} {s}" for r, s in sorted(states.items()))
            raise LaunchTimeout(
                f"{path.name}: the job ran past timeout_s={timeout_s:g} s and was killed "
                f"(all {nproc} ranks). Where the ranks were:\n{where}\nLast lines:\n{tail}",
                returncode=proc.returncode, output=lines, states=states)
        if proc.returncode != 0:
            rank, message, tb = _root_cause(log_dir, result_dir)
            if rank is None:
                rank = _first_failed_rank(lines)
            if not tb and rank is not None:
                tb = _traceback_from_lines(lines, rank)
            head = f"{path.name} failed: rank {rank} raised first" if rank is not None \
                else f"{path.name} failed (exit code {proc.returncode})"
            codes = _exit_codes(lines)
            if not message or _SECONDARY.search(message):
                # No rank raised, or only echoes of a dead peer were raised: the root cause is
                # a rank that exited with a code of its own (os._exit, sys.exit) and left no
                # exception record; the others ended by torchrun's signal (negative codes).
                # Which rank torchrun happened to list first, or what a rank last printed, says
                # nothing then, so neither is presented as the error.
                silent = [r for r, c in sorted(codes.items()) if c > 0 and not
                          (result_dir / f"failed_rank{r}.json").exists()]
                if silent:
                    rank = silent[0]
                    tb = _traceback_from_lines(lines, rank)
                    tb = tb if tb.startswith("Traceback") else ""
                    head = (f"{path.name} failed: rank {rank} exited with code {codes[rank]} "
                            f"without a Python exception; the others lost their peer")
            detail = message if message else ""
            diagnosis, states = _diagnose(result_dir, nproc, message, tb,
                                          child_env.get("MPU_LAB_TIMEOUT_S"), codes)
            raise LaunchError(f"{head}{': ' + detail if detail else ''}\n"
                              f"{diagnosis + chr(10) if diagnosis else ''}{tb}".rstrip(),
                              rank=rank, traceback=tb, returncode=proc.returncode, output=lines,
                              states=states)
        results = []
        for r in range(nproc):
            f = result_dir / f"rank{r}.json"
            results.append(json.loads(f.read_text()) if f.exists() else None)
        return LaunchResult(results, lines, proc.returncode, elapsed, nproc, command)
    finally:
        shutil.rmtree(work, ignore_errors=True)
