"""Run one notebook with papermill in a child process and watch it for a kernel that has stopped
answering.

Why: at 8 ranks on a CPU machine a regeneration once sat on one cell with the kernel and
papermill both idle, waiting for a reply that never came, until the cell timeout (900 s); the
same notebook then ran in 17 s. A cell that is merely long keeps using CPU (the kernel, or the
torchrun jobs and ipyparallel engines it started); a lost reply uses none.

So papermill runs in a child process (``python -c`` calling :func:`_child_main`) that prints a
marker line when a cell starts, when it finishes and for every output. The parent reads those
lines and samples the CPU time of the child's whole process tree
(:mod:`mpu_lab.launcher.process_tree`, on ``psutil``). While a cell is
executing, ``stall_s`` seconds with no marker and less than ``min_cpu`` of one core used by the
tree count as a stall: the tree is killed (the kernel, torchrun jobs, ipyparallel engines;
also descendants that were re-parented, found by an environment tag every process inherits)
and :func:`execute_watched` runs the notebook once more, saying so and why.

Before the kill, the kernel is asked where it was: it starts with a ``faulthandler`` dump of
its threads registered on ``KERNEL_STACK_SIGNAL`` (an ``exec_lines`` startup line, so no cell
and no execution count changes), and the stall report ends with its main thread's innermost
frames: a hang that happens only on another machine says where it waits.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import List, Optional

import psutil

from mpu_lab.labkit import REPO_ROOT
from mpu_lab.launcher import process_tree
from mpu_lab.launcher.pump import pump_lines
from mpu_lab.launcher.diagnosis import INSTALLED_DIRS, repo_relative
from mpu_lab.launcher.worker import FAULTHANDLER_FRAME, main_thread_stack

DEFAULT_STALL_S = 120.0
MARK = "@@mpu_lab_watchdog "
TAG_ENV = "MPU_LAB_WATCHDOG_TAG"   # inherited by every process the notebook starts
STACK_ENV = "MPU_LAB_KERNEL_STACK"   # the file a watched kernel writes its stack dump to
KERNEL_STACK_SIGNAL = getattr(signal, "SIGUSR2", None)    # None on Windows: no dump asked
# Run by the kernel at startup (IPKernelApp.exec_lines): dump every thread to the file named
# by STACK_ENV on KERNEL_STACK_SIGNAL. Names are deleted after: the notebook's namespace stays
# as a learner's kernel has it.
_REGISTER_DUMP = (
    "import faulthandler as _fh, os as _os, signal as _sg\n"
    f"if _os.environ.get({STACK_ENV!r}) and hasattr(_sg, 'SIGUSR2'):\n"
    "    _fh.register(_sg.SIGUSR2, "
    f"file=open(_os.environ[{STACK_ENV!r}], 'w'), all_threads=True)\n"
    "del _fh, _os, _sg")


class NotebookStalled(RuntimeError):
    """The kernel stopped answering: no output and no CPU time while a cell was executing."""


class NotebookFailed(RuntimeError):
    """The notebook raised (or papermill failed); the message is papermill's."""


# --------------------------------------------------------------------------- the child side
def _child_main(spec_path: str) -> int:
    """Inside the child: execute the notebook described by the JSON ``spec_path``."""
    import logging

    import papermill

    spec = json.loads(pathlib.Path(spec_path).read_text())

    def mark(event: str, **fields) -> None:
        sys.stdout.write(MARK + json.dumps(dict(event=event, **fields)) + "\n")
        sys.stdout.flush()

    class Progress(logging.Handler):   # every output papermill logs (log_output=True)
        def emit(self, record):
            mark("output")

    no_output_widget_echo()
    log = logging.getLogger("papermill")
    log.handlers[:] = [Progress()]
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        papermill.execute_notebook(
            spec["input"], spec["output"], parameters=spec["parameters"] or None,
            kernel_name=spec["kernel"], cwd=spec["cwd"], progress_bar=False, log_output=True,
            request_save_on_cell_execute=False, execution_timeout=spec["timeout_s"],
            extra_arguments=[f"--IPKernelApp.exec_lines={_REGISTER_DUMP}"],
            on_cell_execute=lambda cell, cell_index: mark(
                "start", cell=cell_index, line=cell.source.strip().splitlines()[0][:60]),
            on_cell_executed=lambda cell, cell_index, execute_reply: mark("done", cell=cell_index),
            on_cell_error=lambda cell, cell_index, execute_reply: mark("done", cell=cell_index))
    except Exception as exc:  # papermill's PapermillExecutionError included
        pathlib.Path(spec["error"]).write_text(str(exc) or type(exc).__name__)
        return 1
    return 0


def no_output_widget_echo() -> None:
    """nbclient's stand-in for a browser's Output widget echoes every output captured into the
    widget back to the kernel, on the shell channel, from its IOPub reader, while its shell
    reader awaits the cell's execute_reply on the same socket. Now and then that reply is then
    never seen: kernel and papermill both idle until the cell timeout (nbclient issue #312,
    open). An ipywidgets ``interactive`` cell captures its figure so: lab 01's widget cell hung
    so on an H200 and, with two notebooks at once, here. The echo only updates the kernel-side
    copy of the widget's outputs, which nobody reads in a batch run, so it is not sent."""
    from nbclient.output_widget import OutputWidget    # papermill's executor (nbclient)

    OutputWidget.sync_state = lambda self: None


_CHILD_CODE = ("import sys; from mpu_lab.labkit.notebooks.watchdog import _child_main; "
               "sys.exit(_child_main(sys.argv[1]))")


# --------------------------------------------------------------------------- the process tree
def kill_tree(proc: subprocess.Popen, tag: str, grace_s: float = 1.0) -> List[int]:
    """Stop the child, its descendants and every process tagged ``tag`` (SIGTERM, then SIGKILL
    what is left after ``grace_s``; look again until none is left). Returns the PIDs stopped."""
    return process_tree.kill_tree(proc, grace_s, also=lambda: process_tree.tagged(TAG_ENV, tag))


class _CpuMeter:
    """CPU seconds used by a process tree, summed over the intervals between samples (a
    process that exits keeps what it used; a new one counts all it used; a reaped child counts
    through its parent's ``children_*`` times)."""

    def __init__(self, pid: int):
        self.pid, self.last, self.total = pid, {}, 0.0

    def sample(self) -> float:
        now = {}
        for p in process_tree.tree(self.pid):
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                now[p.pid] = t.user + t.system + t.children_user + t.children_system
        self.total += sum(max(0.0, c - self.last.get(pid, 0.0)) for pid, c in now.items())
        self.last = now
        return self.total


def kernel_stack(root_pid: int, dump: pathlib.Path, wait_s: float = 2.0, frames: int = 12) -> str:
    """Where the notebook's kernel (an ``ipykernel`` process under ``root_pid``) is: its main
    thread's frames, innermost first, as ``file:line in function``, down to the cell's line
    (a cell's file is "the cell"; IPython's frames below it are the same for every cell), at
    most ``frames``. "" when no kernel wrote a dump within ``wait_s``."""
    if KERNEL_STACK_SIGNAL is None:
        return ""
    for p in process_tree.tree(root_pid)[1:]:
        with contextlib.suppress(psutil.Error):
            if "ipykernel" in " ".join(p.cmdline()):
                p.send_signal(KERNEL_STACK_SIGNAL)
    deadline = time.monotonic() + wait_s
    text = ""
    while time.monotonic() < deadline:
        text = dump.read_text() if dump.exists() else ""
        if FAULTHANDLER_FRAME.search(text):
            time.sleep(0.1)                      # the rest of the dump follows at once
            text = dump.read_text()
            break
        time.sleep(0.05)
    found = [f"{_frame_file(f)}:{line} in {func}"
             for f, line, func in FAULTHANDLER_FRAME.findall(main_thread_stack(text))]
    cell = next((i for i, f in enumerate(found) if f.startswith("the cell:")), len(found))
    return "; ".join(found[:min(cell + 1, frames)])


def _frame_file(path: str) -> str:
    """A cell's file is "the cell"; an installed package's file is named from its package."""
    p = pathlib.Path(path)
    if p.parent.name.startswith("ipykernel_"):
        return "the cell"
    installed = [i for i, part in enumerate(p.parts) if part in INSTALLED_DIRS]
    if installed:
        return "/".join(p.parts[installed[-1] + 1:])
    return repo_relative(path) or path


# --------------------------------------------------------------------------- the parent side
@contextlib.contextmanager
def terminate_as_exit():
    """While inside: SIGTERM (``kill``, a cancelled CI job, a batch system's time limit) raises
    ``SystemExit`` in the main thread instead of ending the process at once, so that
    :func:`run_once` kills the notebook's process tree (kernel, torchrun jobs, engines: they
    run in sessions of their own and would outlive it). Ctrl-C already arrives as
    ``KeyboardInterrupt``. Outside the main thread (no signal handlers there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_once(source: pathlib.Path, output: pathlib.Path, parameters: Optional[dict],
             kernel: str, cwd: str, timeout_s: Optional[int], stall_s: float = DEFAULT_STALL_S,
             min_cpu: float = 0.05, poll_s: float = 0.5):
    """Execute ``source`` into ``output`` in a watched child process; return nothing.

    Raises :class:`NotebookStalled` (the tree was killed) or :class:`NotebookFailed`.
    ``stall_s <= 0`` turns the stall check off. ``min_cpu``: the share of one core below which
    the tree counts as idle.
    """
    tag = uuid.uuid4().hex
    error = output.with_suffix(".error.txt")
    spec = output.with_suffix(".spec.json")
    spec.write_text(json.dumps(dict(input=str(source), output=str(output), error=str(error),
                                    parameters=parameters or {}, kernel=kernel, cwd=cwd,
                                    timeout_s=timeout_s)))
    dump = output.with_suffix(".stack.txt")
    env = dict(os.environ)
    env[TAG_ENV], env[STACK_ENV] = tag, str(dump)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-c", _CHILD_CODE, str(spec)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    lines = pump_lines(proc.stdout)
    meter = _CpuMeter(proc.pid)
    samples = collections.deque([(time.monotonic(), meter.sample())])
    last_progress, cell, line = time.monotonic(), None, ""
    tail = collections.deque(maxlen=20)
    executing = finished = False
    try:
        while not finished:
            deadline = time.monotonic() + poll_s
            while True:   # read what came in this interval
                try:
                    raw = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if raw is None:
                    finished = True
                    break
                last_progress = time.monotonic()
                if raw.startswith(MARK):
                    event = json.loads(raw[len(MARK):])
                    if event["event"] in ("start", "done"):
                        executing, cell = event["event"] == "start", event.get("cell", cell)
                        line = event.get("line", line)
                else:
                    tail.append(raw.rstrip("\n"))
            now = time.monotonic()
            samples.append((now, meter.sample()))
            while len(samples) > 2 and samples[1][0] <= now - stall_s:
                samples.popleft()     # keep one sample at or before the window's start
            idle_s = now - last_progress
            if stall_s > 0 and executing and not finished and idle_s >= stall_s:
                start_t, start_cpu = samples[0]
                used = samples[-1][1] - start_cpu
                if start_t <= now - stall_s and used < min_cpu * (now - start_t):
                    where = kernel_stack(proc.pid, dump)
                    killed = kill_tree(proc, tag)
                    raise NotebookStalled(
                        f"the kernel stopped answering: cell {cell} ({line!r}) executing, no output for "
                        f"{idle_s:.0f} s and {used:.2f} CPU-s used by its process tree in "
                        f"{now - start_t:.0f} s (stall_s={stall_s:g}); killed {len(killed)} "
                        f"processes ({', '.join(map(str, killed))}); the kernel was at: "
                        f"{where or 'no stack dump came back'}")
        proc.wait()
    except BaseException:   # the stall, KeyboardInterrupt included: leave nothing behind
        kill_tree(proc, tag)
        raise
    finally:
        leftovers = process_tree.tagged(TAG_ENV, tag)
        if leftovers:   # a notebook must not leave processes behind it (an engine, a job)
            kill_tree(proc, tag)
        spec.unlink(missing_ok=True)
        dump.unlink(missing_ok=True)
    if error.exists():
        raise NotebookFailed(error.read_text())
    if proc.returncode != 0 or not output.exists():
        raise NotebookFailed(f"papermill's process exited with code {proc.returncode}: "
                             + " | ".join(tail))


def execute_watched(source_nb, cwd: pathlib.Path, parameters: Optional[dict],
                    kernel: str = "python3", timeout_s: Optional[int] = None,
                    stall_s: float = DEFAULT_STALL_S, retries: int = 1, out=sys.stdout,
                    name: Optional[str] = None, **watch):
    """Execute the notebook node ``source_nb`` in ``cwd``; return the executed node.

    A stall (:class:`NotebookStalled`) is retried ``retries`` times, printing why; a stall on
    the last try, or an error in a cell (:class:`NotebookFailed`), raises.
    """
    import nbformat

    name = name or "notebook"
    with tempfile.TemporaryDirectory(prefix="mpu_lab_nb_") as tmp:
        source = pathlib.Path(tmp) / "input.ipynb"
        output = pathlib.Path(tmp) / "output.ipynb"
        nbformat.write(source_nb, str(source))
        for attempt in range(retries + 1):
            try:
                run_once(source, output, parameters, kernel, str(cwd), timeout_s, stall_s,
                         **watch)
                return nbformat.read(str(output), as_version=4)
            except NotebookStalled as exc:
                if attempt == retries:
                    raise NotebookStalled(f"{exc}; gave up after {retries + 1} tries") from None
                print(f"{name}: {exc}; retrying ({attempt + 1} of {retries})", file=out,
                      flush=True)
                output.unlink(missing_ok=True)
    raise AssertionError("unreachable")
