"""Process trees, read and stopped with psutil: the one place the launcher (a torchrun job), the
notebook watchdog (a kernel and what it started) and the playground (ipyparallel engines and
their controller) find a process's descendants and end them.

:func:`kill_tree` sends SIGTERM to a child, waits up to a grace period for it (a torchrun agent
stops its workers itself), then to every descendant left, sends SIGKILL to what is left after
the grace period, and looks again (a process may start one while it is being
stopped) until nothing is left, so no orphan outlives a job. Processes are signalled one by one,
not by process group: torchrun's workers and the engines run in sessions of their own.
A zombie (exited, not yet reaped by its parent) counts as gone: it holds no resources and
cannot be killed.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Callable, Iterable, List, Optional, Sequence

import psutil

POLL_S = 0.05       # how often a wait looks whether the processes are gone
MAX_ROUNDS = 5      # kill_tree looks this often for processes started while it stops others


def tree(pid: int) -> List[psutil.Process]:
    """``pid`` and all its descendants (zombies included); empty when ``pid`` is gone."""
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.Error:
        return []


def is_alive(process: psutil.Process) -> bool:
    """Running (or runnable, or sleeping) and not a zombie; false once its PID was reused."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:     # access denied: it exists
        return True


def descendants(pid: int) -> List[int]:
    """PIDs of the live descendants of ``pid``."""
    return [p.pid for p in tree(pid)[1:] if is_alive(p)]


def processes(pids: Iterable[int]) -> List[psutil.Process]:
    """The processes of ``pids`` that still exist."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found.append(psutil.Process(pid))
    return found


def tagged(name: str, value: str) -> List[psutil.Process]:
    """Every live process of this user whose environment has ``name=value``: a variable that
    every process a child starts inherits, so re-parented orphans are found too."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get(name) == value and is_alive(p):
                found.append(p)
    return found


def _send(procs: Iterable[psutil.Process], signum: int) -> None:
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signum)


def wait_gone(procs: Sequence[psutil.Process], timeout_s: float,
              child: Optional[subprocess.Popen] = None) -> List[psutil.Process]:
    """Wait up to ``timeout_s`` for ``procs`` to end; return those still alive. ``child``, a
    ``Popen`` among them, is reaped through ``Popen.poll`` (so its return code is kept)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if child is not None:
            child.poll()
        alive = [p for p in procs if is_alive(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(POLL_S)


def stop(procs: Sequence[psutil.Process], grace_s: float,
         child: Optional[subprocess.Popen] = None) -> List[psutil.Process]:
    """SIGTERM every process of ``procs``, SIGKILL those alive after ``grace_s``, wait up to
    ``grace_s`` more; return any still alive (none, unless a process cannot be killed)."""
    _send(procs, signal.SIGTERM)
    alive = wait_gone(procs, grace_s, child)
    _send(alive, signal.SIGKILL)
    return wait_gone(alive, grace_s, child)


def kill_tree(proc: subprocess.Popen, grace_s: float = 5.0,
              also: Optional[Callable[[], List[psutil.Process]]] = None) -> List[int]:
    """Stop the child ``proc``, its descendants and the processes ``also()`` names (e.g.
    :func:`tagged`): SIGTERM to ``proc`` and up to ``grace_s`` for it to end, then SIGTERM to
    the rest, SIGKILL after ``grace_s``, then look again, until none is left. Returns the PIDs
    signalled from here, sorted (not those ``proc`` stopped itself); ``proc`` is reaped."""
    me = os.getpid()
    roots = processes([proc.pid]) if proc.returncode is None else []   # not yet reaped
    family = [p for root in roots for p in tree(root.pid)]   # the roots among them
    stopped = {p.pid: p for p in roots if is_alive(p)}
    # The child first, alone: a torchrun agent passes one SIGTERM to each worker and waits
    # for them. A second SIGTERM from here, landing while a worker writes its stack dump,
    # would end that worker mid-dump (faulthandler chains to the default action).
    _send(stopped.values(), signal.SIGTERM)
    wait_gone(list(stopped.values()), grace_s, child=proc)
    for _ in range(MAX_ROUNDS):
        found = family + (also() if also is not None else [])
        for p in roots + list(stopped.values()):   # what was stopped may have started more
            with contextlib.suppress(psutil.Error):
                if p.is_running():                   # (false once its PID is reused)
                    found += p.children(recursive=True)
        targets = {p.pid: p for p in found if p.pid != me and is_alive(p)}
        if not targets:
            break
        stopped.update(targets)
        stop(list(targets.values()), grace_s, child=proc)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    return sorted(stopped)
