"""torchrun's agent without its ``import torch``: each job's agent is forked from
:mod:`multiprocessing`'s fork server, which imported ``torch.distributed.run`` once for the
life of this process (a notebook kernel, a test worker).

``python -m torch.distributed.run ...`` spends 1.5-2 CPU-seconds importing torch before it
starts a single rank, and every job pays it: on a 2-core laptop that is most of what a small
job costs. :func:`start` runs the same program, torch's own ``torch.distributed.run.main`` with
the same arguments, environment, working directory and output, in a process of its own session
forked from a server that has torch loaded already. The agent then starts every rank as usual,
its output teed into the agent's, its failures recorded by torch elastic: a fresh
``python -u script.py`` on a machine with a GPU, and elsewhere a rank forked by the agent's
rank server (:mod:`mpu_lab.launcher.rank_server`), which saves each rank its own imports.
The handle :func:`start` returns, :class:`AgentProcess`, is the part of ``subprocess.Popen``
the runner uses (``pid``, ``stdout``, ``poll``, ``wait``, ``returncode``);
stopping the tree (:func:`mpu_lab.launcher.process_tree.kill_tree`) works on it unchanged.

The fork server and multiprocessing's resource tracker, both children of this process, stay
until this process ends. A forked process imports this process's ``__main__`` module again, as
``__mp_main__`` (multiprocessing's rule), which is safe for a notebook kernel, ``python -c``
and ``python -m module``, but not for a script run by its path, whose top level may be the work
itself. So from such a script, where there is no fork server (Windows), or where the job needs
another interpreter, :func:`start` runs ``command`` with ``subprocess.Popen``, as before.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Dict, List, Optional, Sequence

import psutil

from mpu_lab.launcher import rank_server

# What a torchrun agent imports on its way to starting ranks, loaded once in the server.
PRELOAD = [
    "torch.distributed.run",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
    "encodings.idna",          # the rendezvous's host name
]
_AGENT_MODULE = ["-m", "torch.distributed.run"]
# The command lines of the two processes multiprocessing keeps for this one (see helpers()).
HELPER_MARKS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
_lock = threading.Lock()
_context = None


class AgentProcess:
    """A forked torchrun agent, seen through the part of ``subprocess.Popen`` the runner uses:
    ``returncode`` is None while it runs, then its exit code (``-N`` for signal N)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, stdout):
        self._process = process
        self.pid = process.pid
        self.stdout = stdout

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("torchrun agent", timeout)
        return self._process.exitcode


def fork_server():
    """The forkserver context, its server preloading :data:`PRELOAD` (started on first use);
    None where the platform has none."""
    global _context
    with _lock:
        if _context is None and "forkserver" in multiprocessing.get_all_start_methods():
            _context = multiprocessing.get_context("forkserver")
            ranks = rank_server.PRELOAD if rank_server.wanted(dict(os.environ)) else []
            _context.set_forkserver_preload(PRELOAD + ranks)
    return _context


def helpers(pid: Optional[int] = None) -> List[int]:
    """PIDs of the fork server and multiprocessing's resource tracker among the children of
    ``pid`` (default: this process): the launcher's own helpers, idle between jobs, which end
    with that process. They are not a job's processes, so "what did my jobs leave behind" is
    every other descendant."""
    found = []
    for child in psutil.Process(pid).children():
        with contextlib.suppress(psutil.Error):
            if is_helper(" ".join(child.cmdline())):
                found.append(child.pid)
    return found


def is_helper(cmdline: str) -> bool:
    """Whether a process with this command line is the fork server or the resource tracker."""
    return any(mark in cmdline for mark in HELPER_MARKS)


def start(command: Sequence[str], env: Dict[str, str], cwd=None):
    """Start ``command`` (``python -m torch.distributed.run ...``) with its output (stdout and
    stderr together, text, line by line) on ``.stdout``: forked from the fork server when
    ``command`` runs this interpreter, else as a ``subprocess.Popen``."""
    python, module, args = command[0], list(command[1:3]), list(command[3:])
    forkable = python == sys.executable and module == _AGENT_MODULE and main_imports_safely()
    context = fork_server() if forkable else None
    if context is None:
        return subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, env=env, cwd=cwd, start_new_session=True)
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=run_agent,
                              args=(args, env, cwd, writer, rank_server.wanted(env)),
                              daemon=True, name="torchrun")
    try:
        process.start()
    finally:
        writer.close()
    stdout = open(os.dup(reader.fileno()), "r", buffering=1)
    reader.close()
    return AgentProcess(process, stdout)


def main_imports_safely() -> bool:
    """Whether a forked process may import this process's ``__main__`` again, as the fork
    server's children do: yes for a notebook kernel, ``python -c`` and a module run with ``-m``
    (its top level sits behind ``if __name__ == "__main__":``), no for a script run by its path
    or from standard input, whose top level may be the work itself."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return True
    return getattr(main, "__file__", None) is None


def run_agent(args: List[str], env: Dict[str, str], cwd, output: Connection,
              fork_ranks: bool = False) -> None:
    """In the forked process: become what ``python -u -m torch.distributed.run args`` started
    with ``start_new_session=True`` would be, run torchrun's ``main``, exit with its code. With
    ``fork_ranks``, torchrun's ranks are forked by a rank server (:mod:`rank_server`)."""
    load_env = dict(os.environ)         # what the loaded modules were imported under
    os.setsid()
    for fd in (1, 2):
        os.dup2(output.fileno(), fd)
    output.close()
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    server = None
    if fork_ranks:
        try:
            server = rank_server.start(load_env)
        except Exception:              # (a socket path too long, a noexec /tmp): as programs
            server = None
    if server is not None:
        os.environ.update(server.env)
    import torch.distributed.run as torchrun
    sys.argv = [torchrun.__file__, *args]       # what ``python -m`` sets (argparse's prog)
    code = 0
    try:
        torchrun.main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:   # as the interpreter would: the traceback, exit code 1
        traceback.print_exc()
        code = 1
    if server is not None:
        rank_server.stop(server)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
