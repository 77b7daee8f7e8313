"""The process tree of a torchrun job: its live descendants (from ``/proc``, or ``ps``) and
:func:`kill_tree`, which stops torchrun and every worker — SIGTERM, then SIGKILL after a grace
period — and checks them gone, so no orphan workers outlive a job (the lab's own)."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time
from typing import Dict, List


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
