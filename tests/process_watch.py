"""The process watcher of the reliability and fault tests: every process a job starts, told
apart by its place in the process tree.

``ProcessWatch`` polls this process's descendants while its ``with`` block runs:
``seen[pid] = (create_time, cmdline)``, ``parent[pid]`` (its parent's PID when first seen),
``gone[pid] = time.time()`` when it ended (or became a zombie). Whether a PID is alive is judged
by PID *and* start time, so a reused PID is not the same process.

A torchrun **agent** is a child of this process running ``torch.distributed.run``, or a child
of this process's fork server (the launcher forks agents from there,
:mod:`mpu_lab.launcher.agent`); a **worker** is a direct child of an agent that runs the job's
script. The fork server and multiprocessing's resource tracker are this process's helpers, not a
job's: they live as long as this process, and are left out of :meth:`ProcessWatch.still_alive`. What else appears in the tree is
neither, but must still be gone at the end (:meth:`ProcessWatch.still_alive` covers every
descendant). CUDA builds of torch start such processes: a fork of the agent or of a worker that
keeps its parent's command line until it execs, ``/sbin/ldconfig -p`` probing libraries at
import. So a child of an agent whose command line is still the agent's
(``torch.distributed.run``) is not a worker, and a worker's own children are never counted.
"""
import threading
import time
from typing import Dict, List, Tuple

import psutil

from mpu_lab.launcher import agent

AGENT_MARK = "torch.distributed.run"


class ProcessWatch:
    # Every 0.1 s: a worker or an agent lives for seconds (it imports torch first), and a poll
    # reads /proc for every process of the machine (psutil's children) and each seen PID again:
    # at 0.02 s the watch alone took 10 % of a core on a quiet machine, more beside other jobs.
    def __init__(self, interval_s: float = 0.1):
        self.interval_s = interval_s
        self.seen: Dict[int, Tuple[float, str]] = {}
        self.gone: Dict[int, float] = {}
        self.parent: Dict[int, int] = {}
        self._stop = threading.Event()
        self._me = psutil.Process()
        # Processes this test process already had (a playground world a session fixture keeps
        # up for other tests of this pytest worker) and anything they start are not the job's.
        self._before = {c.pid for c in self._me.children(recursive=True)}
        # The fork server and resource tracker (children of this process), there already or not.
        self.helpers = set(agent.helpers())

    def _poll(self):
        try:
            children = self._me.children(recursive=True)
        except psutil.Error:
            children = []
        for c in children:
            if c.pid in self._before:
                continue
            try:
                if (c.pid not in self.parent and c.ppid() in self._before
                        and c.ppid() not in self.helpers):
                    self._before.add(c.pid)      # started by a process that was there already
                    continue
            except psutil.Error:
                continue
            try:   # re-read: a fresh child shows its parent's command line until it execs
                cmd = " ".join(c.cmdline())
                if cmd or c.pid not in self.seen:   # a zombie's command line is empty
                    self.seen[c.pid] = (c.create_time(), cmd)
                self.parent.setdefault(c.pid, c.ppid())
                if c.ppid() == self._me.pid and agent.is_helper(cmd):
                    self.helpers.add(c.pid)
            except psutil.Error:
                continue
        now = time.time()
        for pid in self.seen:
            if pid not in self.gone and not self.alive(pid):
                self.gone[pid] = now

    def alive(self, pid: int) -> bool:
        try:
            p = psutil.Process(pid)
            return p.create_time() == self.seen[pid][0] and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _loop(self):
        while not self._stop.is_set():
            self._poll()
            time.sleep(self.interval_s)

    def __enter__(self):
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._poll()

    def torchruns(self, marker: str = "") -> List[int]:
        """PIDs of the torchrun agents (forked from this process's fork server, or this
        process's children running torch.distributed.run) whose command line, or one of whose
        workers' command lines, holds ``marker``."""
        agents = [pid for pid, (_, cmd) in self.seen.items() if pid not in self.helpers and (
            self.parent.get(pid) in self.helpers
            or (self.parent.get(pid) == self._me.pid and AGENT_MARK in cmd))]
        return [pid for pid in agents if marker in self.seen[pid][1] or any(
            self.parent.get(w) == pid and marker in cmd for w, (_, cmd) in self.seen.items())]

    def workers(self, script) -> List[int]:
        """PIDs of the workers running ``script``: direct children of an agent whose command
        line runs the script and is not the agent's own (a fork of the agent before it execs)."""
        agents = set(self.torchruns())
        return [pid for pid, (_, cmd) in self.seen.items()
                if self.parent.get(pid) in agents and str(script) in cmd
                and AGENT_MARK not in cmd]

    def job(self, marker: str) -> Tuple[List[int], List[int]]:
        """``(agents, workers)`` of the job whose agent's command line holds ``marker``."""
        self._poll()
        agents = self.torchruns(marker)
        workers = [pid for pid, (_, cmd) in self.seen.items()
                   if self.parent.get(pid) in agents and marker in cmd and AGENT_MARK not in cmd]
        return agents, workers

    def tree(self, roots) -> List[int]:
        """``roots`` and every process seen below them (workers, and whatever they started)."""
        out, todo = set(), list(roots)
        while todo:
            pid = todo.pop()
            if pid not in out:
                out.add(pid)
                todo += [c for c, parent in self.parent.items() if parent == pid]
        return sorted(out)

    def still_alive(self, pids=None) -> List[int]:
        """Which of ``pids`` (default: every process seen) are still running."""
        return [pid for pid in (self.seen if pids is None else pids)
                if self.alive(pid) and pid not in self.helpers]
