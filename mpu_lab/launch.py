"""Run a ``launch/`` script under ``torchrun`` from a notebook or a script.

    >>> from mpu_lab.launch import run
    >>> job = run("collectives.py", ["--test", "copy"], nproc=8)     # doctest: +SKIP
    >>> job.results[5]                                                # doctest: +SKIP

What it does for you (PITFALLS.md, "Running torchrun from a notebook"):

* ``torchrun --standalone``: a free rendezvous port every time, so two notebooks never collide.
* ``OMP_NUM_THREADS`` set (cores / ranks), ``PYTHONUNBUFFERED=1``; each output line is streamed
  as it comes, prefixed with the *global* rank that printed it (``--tee`` plus torchrun's
  ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``), or collated in rank order after the job
  (``show="ranks"``: deterministic, for notebooks that nbval compares).
* Results as Python data: a worker calls :func:`report` with anything JSON-able; ``run``
  returns them in rank order.
* Failure is an exception, :class:`LaunchError`, naming the root-cause rank (the first to fail,
  from torch elastic's error files written by ``@record``) with its traceback. A time limit per
  job; on timeout, error or ``KeyboardInterrupt`` the whole process tree is terminated and
  checked gone — no orphan workers.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
LAUNCH_DIR = REPO_ROOT / "launch"
RESULT_DIR_ENV = "MPU_LAB_RESULT_DIR"
_PREFIX = re.compile(r"^\[rank(\d+)\]:(.*)$")


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


# --------------------------------------------------------------------------- worker side
def report(obj: Any) -> Any:
    """Hand ``obj`` (JSON-able) back to :func:`run` from inside a worker. Returns ``obj``.

    Without the launcher (a plain ``torchrun`` call) it does nothing, so scripts run either way.
    A later call replaces an earlier one.
    """
    directory = os.environ.get(RESULT_DIR_ENV)
    if directory:
        rank = int(os.environ.get("RANK", "0"))
        path = pathlib.Path(directory) / f"rank{rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(obj))
        tmp.replace(path)   # atomic: the launcher never reads half a file
    return obj


def gather_lines(text: str):
    """Every rank's ``text``, in rank order, on rank 0 (``None`` on the others).

    A collective: every rank of the world calls it. Printing what it returns on rank 0 gives
    deterministic multi-rank output (what nbval compares), unlike ranks printing at will.
    """
    import torch
    import torch.distributed as dist

    from mpu_lab import comm, distributed
    device = distributed.get_device()
    data = torch.tensor(list(text.encode()) or [0], dtype=torch.uint8, device=device)
    longest = comm.all_reduce(torch.tensor([data.numel()], device=device), op=dist.ReduceOp.MAX)
    padded = torch.zeros(int(longest.item()), dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    rows = comm.all_gather(padded.unsqueeze(0))                   # [world, longest]
    if dist.get_rank() != 0:
        return None
    return [bytes(row.tolist()).rstrip(b"\0").decode() for row in rows.cpu()]


def _dump_stack_on_sigterm(directory: str, rank: int) -> None:
    """When torchrun (or :func:`kill_tree`) stops this rank with SIGTERM, write where its main
    thread was to ``stack_rank<r>.txt`` first (``faulthandler``: works even inside a blocked
    C++ collective), then terminate as SIGTERM would. That is how a failure report can say
    where a rank that never joined a collective was stuck."""
    import faulthandler
    try:
        f = open(pathlib.Path(directory) / f"stack_rank{rank}.txt", "w")
        faulthandler.register(signal.SIGTERM, file=f, all_threads=False, chain=True)
    except (OSError, AttributeError, ValueError, RuntimeError):
        pass   # no faulthandler.register (Windows) or no result folder: report less


def entrypoint(fn):
    """Decorate a ``launch/`` script's ``main``: torch elastic's ``@record`` (the traceback goes
    to torchrun's error file) plus a precise failure time, so :func:`run` can tell the rank
    that failed first from the ranks that failed because a peer died; a record of ranks that
    returned, and a stack dump of ranks stopped by SIGTERM (where a hung rank was).

    Under torchrun a rank that raised exits at once (``os._exit(1)``, after the error file and
    the traceback are written): interpreter teardown with a live process group can take a
    second or block on dead peers, and the job's other ranks wait for it."""
    import functools
    import traceback

    from torch.distributed.elastic.multiprocessing.errors import record

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        directory = os.environ.get(RESULT_DIR_ENV)
        rank = int(os.environ.get("RANK", "0"))
        if directory:
            _dump_stack_on_sigterm(directory, rank)
        try:
            out = fn(*args, **kwargs)
        except BaseException as exc:
            if directory and not isinstance(exc, SystemExit):
                info = {"time": time.time(), "rank": rank,
                        "message": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()}
                (pathlib.Path(directory) / f"failed_rank{rank}.json").write_text(json.dumps(info))
            raise
        if directory:
            (pathlib.Path(directory) / f"finished_rank{rank}.json").write_text(
                json.dumps({"time": time.time(), "rank": rank}))
        return out

    recorded = record(wrapper)

    @functools.wraps(fn)
    def exit_promptly(*args, **kwargs):
        try:
            return recorded(*args, **kwargs)
        except SystemExit:
            raise
        except BaseException:
            if "TORCHELASTIC_RUN_ID" not in os.environ:   # called in-process (a test): raise
                raise
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    return exit_promptly


# Messages of ranks that fail only because another rank died first.
_SECONDARY = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|"
                        r"NCCL communicator was aborted|failed to recv|Socket Timeout", re.I)


# --------------------------------------------------------------------------- process tree
def _children_map() -> Dict[int, List[int]]:
    children: Dict[int, List[int]] = {}
    proc = pathlib.Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # pid (comm) state ppid ...; comm may hold spaces, so split after the last ')'
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
        return children
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, ppid = (int(x) for x in line.split())
        children.setdefault(ppid, []).append(pid)
    return children


def descendants(pid: int) -> List[int]:
    """All live descendants of ``pid`` (children first)."""
    children, found, todo = _children_map(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def kill_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> List[int]:
    """Stop torchrun and its workers: SIGTERM, then SIGKILL after ``grace_s``. Returns the PIDs."""
    pids = descendants(proc.pid)
    for pid in [proc.pid] + pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in [proc.pid] + pids):
        try:
            proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
        pids += [p for p in descendants(proc.pid) if p not in pids]
    for pid in [proc.pid] + pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    return pids


# --------------------------------------------------------------------------- launcher side
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


def _load_script(path: pathlib.Path):
    """Import a ``launch/`` script as a module (its ``if __name__ == "__main__"`` part does not
    run), to reuse its argument parser."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"_mpu_lab_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_rank_groups(argv: Sequence[str], nproc: int, cwd=None) -> None:
    from mpu_lab import parallel_state
    a = _load_script(LAUNCH_DIR / "rank_groups.py").parse_args(list(argv))
    parallel_state.generate_rank_groups(nproc, a.tp, a.pp, a.cp, a.order)   # pure: sizes, order


def _check_train_gpt(argv: Sequence[str], nproc: int, cwd=None) -> None:
    from mpu_lab import training
    training.check_launch_args(argv, nproc, cwd=cwd)


# Scripts of launch/ whose flags are checked in this process before torchrun starts (pure:
# no torch.distributed), so a configuration that cannot work fails in well under a second
# with a ValueError naming the numbers, instead of after every rank has started.
PRECHECKS: Dict[str, Callable[..., None]] = {
    "train_gpt.py": _check_train_gpt,
    "rank_groups.py": _check_rank_groups,
}


def precheck(path: pathlib.Path, args: Sequence[str], nproc: int, cwd=None) -> None:
    """Run the pure flag check of ``path`` (a script of ``launch/`` listed in
    :data:`PRECHECKS`) for ``nproc`` ranks. An argparse error becomes a ``ValueError`` with
    argparse's message; ``--help`` is left to the job."""
    import contextlib
    import io
    check = PRECHECKS.get(path.name) if path.parent == LAUNCH_DIR.resolve() else None
    if check is None:
        return
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
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


def _root_cause(log_dir: pathlib.Path, result_dir: pathlib.Path) -> Tuple[Optional[int], str, str]:
    """(rank, message, traceback) of the first failure: from :func:`entrypoint`'s precise
    records if any, else from torch elastic's error files (``@record``, 1 s resolution, so
    ties are broken against errors that only echo a dead peer)."""
    precise = []
    for path in result_dir.glob("failed_rank*.json"):
        try:
            precise.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if precise:
        first = min(precise, key=lambda d: (bool(_SECONDARY.search(d["message"])), d["time"]))
        return first["rank"], first["message"], first["traceback"]
    best = None
    for path in log_dir.rglob("error.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        message = data.get("message", {})
        if isinstance(message, str):
            text, extra = message, {}
        else:
            text, extra = message.get("message", ""), message.get("extraInfo", {})
        stamp = float(extra.get("timestamp", 0) or 0)
        # torchrun writes per-worker folders named by local rank (== global rank, one node)
        try:
            rank = int(path.parent.name)
        except ValueError:
            rank = None
        key = (stamp, bool(_SECONDARY.search(text)))
        if best is None or key < best[0]:
            best = (key, rank, text, extra.get("py_callstack", ""))
    if best is None:
        return None, "", ""
    return best[1], best[2], best[3]


# gloo: "Timed out waiting 5000ms for recv operation"; NCCL's watchdog: "Watchdog caught
# collective operation timeout: WorkNCCL(... Timeout(ms)=...) ran for ... milliseconds".
_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting|operation timeout|Timeout\(ms\)", re.I)
# A traceback frame (File "x.py", line 3, in f) or a faulthandler one (File "x.py", line 3 in f).
_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')
_C10D_FILES = ("distributed_c10d.py",)


def _own_frames(text: str) -> List[Tuple[str, int, str]]:
    """``(file, line, function)`` of the frames of ``text`` (a traceback, outermost first,
    or a faulthandler dump, innermost first) that are neither torch's nor this launcher's."""
    out = []
    for path, line, func in _FRAME.findall(text):
        p = pathlib.Path(path)
        if "torch" in p.parts or p.resolve() == pathlib.Path(__file__).resolve():
            continue
        out.append((path, int(line), func))
    return out


def _short(path: str) -> str:
    try:
        return str(pathlib.Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return pathlib.Path(path).name


def _collective_in(traceback_text: str) -> Optional[str]:
    """The ``torch.distributed`` call a traceback ended in (``all_reduce``, ``barrier``...)."""
    ops = [func for path, _, func in _FRAME.findall(traceback_text)
           if pathlib.Path(path).name in _C10D_FILES and func != "wrapper"]
    return ops[-1] if ops else None


def _where(text: str, innermost_last: bool = True) -> str:
    frames = _own_frames(text)
    if not frames:
        return "an unknown place"
    path, line, func = frames[-1] if innermost_last else frames[0]
    return f"{_short(path)}:{line} in {func}"


def _diagnose(result_dir: pathlib.Path, nproc: int, root_message: str, root_tb: str,
              timeout_s: Optional[str], exit_codes: Optional[Dict[int, int]] = None
              ) -> Tuple[str, Dict[int, str]]:
    """Explain a job that died in a collective: which call, where, which ranks were in it and
    where the others were. Returns ``(text, state per rank)``; text is empty when the root
    cause was no collective problem."""
    states: Dict[int, str] = {}
    failed = {}
    for path in result_dir.glob("failed_rank*.json"):
        try:
            d = json.loads(path.read_text())
            failed[d["rank"]] = d
        except (OSError, ValueError, KeyError):
            continue
    for r in range(nproc):
        if r in failed:
            msg = failed[r]["message"].splitlines()[0] if failed[r]["message"] else ""
            states[r] = f"raised at {_where(failed[r]['traceback'])}: {msg[:160]}"
        elif (result_dir / f"finished_rank{r}.json").exists():
            states[r] = "had returned from main (finished)"
        else:
            stack = result_dir / f"stack_rank{r}.txt"
            text = stack.read_text() if stack.exists() else ""
            code = (exit_codes or {}).get(r)
            if text.strip():
                states[r] = f"was stopped at {_where(text, innermost_last=False)}"
            elif code is not None and code > 0:
                states[r] = (f"exited with code {code} without a Python exception (os._exit, "
                             f"or killed)")
            elif code is not None and code < 0:
                states[r] = f"was killed by signal {-code}"
            else:
                states[r] = "was stopped (no record of where)"
    op = _collective_in(root_tb)
    timed_out = bool(_COLLECTIVE_TIMEOUT.search(root_message))
    if op is None and not (timed_out or _SECONDARY.search(root_message)):
        return "", states
    in_op = sorted(r for r, d in failed.items() if _collective_in(d["traceback"]) == op
                   and _where(d["traceback"]) == _where(root_tb))
    absent = [r for r in range(nproc) if r not in in_op]
    what = f"{op}" if op else "a collective"
    if timed_out:
        limit = f"{timeout_s} s" if timeout_s else "default 60 s"
        head = f"A collective timed out (MPU_LAB_TIMEOUT_S: {limit}): {what} at {_where(root_tb)}"
    elif _SECONDARY.search(root_message):
        head = f"A collective failed because a peer went away: {what} at {_where(root_tb)}"
    else:
        head = f"A collective failed: {what} at {_where(root_tb)}"
    lines = [f"{head}, reached by rank(s) {in_op}; every rank must call it, in the same order."]
    if absent:
        lines.append("Not in it: " + "; ".join(f"rank {r} {states[r]}" for r in absent) + ".")
    return "\n".join(lines), states


def _traceback_from_lines(lines, rank) -> str:
    mine = [t for r, t in lines if r == rank]
    for i, text in enumerate(mine):
        if text.startswith("Traceback (most recent call last)"):
            return "\n".join(mine[i:])
    return "\n".join(mine[-30:])


def _exit_codes(lines) -> Dict[int, int]:
    """``{rank: exit code}`` from torchrun's failure summary (``rank : 1 (local_rank: 1)``
    then ``exitcode : 3 (pid: ...)``); negative codes are signals (-15: SIGTERM)."""
    codes, rank = {}, None
    for r, text in lines:
        if r is not None:
            continue
        m = re.search(r"\brank\s*:\s*(\d+)\s*\(local_rank", text)
        if m:
            rank = int(m.group(1))
            continue
        m = re.search(r"\bexitcode\s*:\s*(-?\d+)", text)
        if m and rank is not None:
            codes.setdefault(rank, int(m.group(1)))
            rank = None
    return codes


def _first_failed_rank(lines) -> Optional[int]:
    """Parse torchrun's failure summary (``rank : 3 (local_rank: 3)``) as a fallback."""
    for _, text in lines:
        m = re.search(r"rank\s*:\s*(\d+)\s*\(local_rank", text)
        if m:
            return int(m.group(1))
    for r, text in lines:
        if r is not None and text.startswith("Traceback"):
            return r
    return None


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
    ``check``: for the scripts in :data:`PRECHECKS` (``train_gpt.py``, ``rank_groups.py``),
    check the flags for ``nproc`` ranks here first — a ``ValueError`` before any process starts.
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
            if raw is None:
                done = True
                break
            text = raw.rstrip("\n")
            m = _PREFIX.match(text)
            rank, text = (int(m.group(1)), m.group(2)) if m else (None, text)
            lines.append((rank, text))
            if show == "live":
                print(f"[rank{rank}] {text}" if rank is not None else text, flush=True)
            if on_line is not None:
                on_line(rank, text)
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
            if message and _SECONDARY.search(message):
                # Only echoes of a dead peer were raised: the root cause is a rank that died
                # without an exception (os._exit, a signal, the OOM killer).
                silent = [r for r, c in sorted(codes.items()) if c > 0 and not
                          (result_dir / f"failed_rank{r}.json").exists()]
                if silent:
                    rank = silent[0]
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
