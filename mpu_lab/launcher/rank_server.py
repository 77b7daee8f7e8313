"""Ranks forked from a process that has torch loaded: a job's ranks without ``import torch``.

A rank that torchrun starts as ``python -u script.py`` spends its first seconds importing
torch, and a rank that builds an optimizer as much again importing ``torch._dynamo`` (torch's
optimizers reach it on first use): 2-5 CPU-seconds per rank on a 2-core laptop, before the
rank's own work. Where a job's agent is forked (:mod:`mpu_lab.launcher.agent`), it also starts
a rank server, a process forked from it that has torch and those modules loaded already, and
points torchrun's ``PYTHON_EXEC`` at :mod:`rank_client`, so that for each rank torchrun starts
``rank_client -u script.py ...``: a small interpreter that hands its arguments, directory,
environment, standard streams and signals to the server and ends as the rank ends. The server
forks the rank, which becomes what ``python -u script.py`` would have been, runs it and ends
as it would (:mod:`mpu_lab.launcher.fresh_rank`). Torchrun, its error files, the launcher and
the diagnosis see the client: its exit code and signals are the rank's.

A rank is started as a program instead (the client becomes ``python``) where a fork cannot
give what the environment asks for: a variable that torch, Python or the thread libraries
read while they load (``PYTHON*``, ``TORCH*``, ``OMP_*``, ``MKL_*``, ``CUDA*``, ``LD_*``,
locale, ...) that differs from the server's, other than the ones read at run time
(:data:`RUN_TIME`, and ``OMP_NUM_THREADS``, which the rank applies itself). Ranks are never
forked on a machine with a GPU (:func:`wanted`): a process that has loaded CUDA's driver
cannot be forked safely; nor off Linux. ``MPU_LAB_FORK_RANKS=0`` turns it off.

The ranks are children of the server, the server of the agent: the job's process tree still
holds them (:func:`~mpu_lab.launcher.process_tree.kill_tree`), and :func:`forked_rank` finds
the rank a client stands for (for samplers that read a rank's own CPU).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from typing import Dict, List, Optional

from mpu_lab.launcher import fresh_rank, rank_client

# Names a fork cannot change after they were read while loading (checked, prefix by prefix)
LOAD_TIME = ("PYTHON", "PYTORCH", "TORCH", "ATEN_", "OMP_", "KMP_", "GOMP_", "MKL_",
             "OPENBLAS_", "DNNL_", "ONEDNN_", "NPY_", "CUDA", "NVIDIA_", "HIP_", "ROCM", "TRITON",
             "LD_", "MALLOC_", "LANG", "LC_", "TZ")
# ... of which these are read at run time, or applied by the rank itself
RUN_TIME = {"PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHON_EXEC",
            "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHINDUCTOR_CACHE_DIR"}
RUN_TIME_PREFIXES = ("TORCHELASTIC_",)
# The modules the rank server adds to what the agent's fork server loaded
PRELOAD = ["torch._dynamo", "torch.optim", "torch.nn.parallel", "torch.distributed.checkpoint"]
SWITCH_ENV = "MPU_LAB_FORK_RANKS"
_GPU_DEVICES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/proc/driver/nvidia")


def wanted(env: Dict[str, str]) -> bool:
    """Whether a job with environment ``env`` forks its ranks: on Linux (a client is known by
    its socket's peer credentials), not where the machine has a GPU driver, nor where
    ``MPU_LAB_FORK_RANKS=0`` or torchrun's ``PYTHON_EXEC`` is set."""
    if env.get(SWITCH_ENV, "1") == "0" or "PYTHON_EXEC" in env:
        return False
    if not sys.platform.startswith("linux") or " " in sys.executable:
        return False                   # (a client's first line is ``#!python -IS``)
    return not any(os.path.exists(p) for p in _GPU_DEVICES)


def differs_at_load(load_env: Dict[str, str], env: Dict[str, str]) -> List[str]:
    """The variables read while loading whose value in ``env`` differs from ``load_env``."""
    names = set(load_env) | set(env)
    return sorted(n for n in names if n.startswith(LOAD_TIME) and n not in RUN_TIME
                  and not n.startswith(RUN_TIME_PREFIXES) and load_env.get(n) != env.get(n))


@dataclasses.dataclass
class Server:
    """The agent's handle on its rank server: ``env`` goes into torchrun's environment."""
    pid: int
    alive: int
    directory: str
    env: Dict[str, str]


def start(load_env: Dict[str, str]) -> Server:
    """In the agent, before torchrun starts: fork the rank server (``load_env``: the
    environment the loaded modules were imported under)."""
    directory = tempfile.mkdtemp(prefix="mpu_lab_ranks_")
    address = os.path.join(directory, "server")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(128)
    client = os.path.join(directory, "python")
    with open(rank_client.__file__) as src, open(client, "w") as dst:
        dst.write(f"#!{sys.executable} -IS\n" + src.read())
    os.chmod(client, 0o755)
    if os.statvfs(directory).f_flag & os.ST_NOEXEC:
        raise OSError(f"{directory} is on a file system that cannot run programs")
    probe = [sys.executable, "-c", "import sys, json; print(json.dumps(sys.path))"]
    env = {k: v for k, v in load_env.items() if k != "PYTHONPATH"}
    base_path = json.loads(subprocess.check_output(probe, env=env))[1:]
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        code = 1
        try:
            _Serving(listener, alive_r, base_path, load_env, directory).serve()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            shutil.rmtree(directory, ignore_errors=True)
            os._exit(code)
    os.close(alive_r)
    listener.close()
    return Server(pid, alive_w, directory, {rank_client.SERVER_ENV: address,
                                            "PYTHON_EXEC": client,
                                            rank_client.PYTHON_ENV: sys.executable})


def stop(server: Server) -> None:
    """In the agent, after torchrun ended: the server ends (killing any rank still there)."""
    os.close(server.alive)
    os.waitpid(server.pid, 0)
    shutil.rmtree(server.directory, ignore_errors=True)   # also if the server was killed


def forked_rank(client_pid: int, client_env: Dict[str, str]) -> Optional[int]:
    """The PID of the rank that the client ``client_pid`` (environment ``client_env``) stands
    for; None for a process that is not a client, or before its rank is forked."""
    address = client_env.get(rank_client.SERVER_ENV)
    if not address:
        return None
    try:
        with open(os.path.join(os.path.dirname(address), f"rank_of_{client_pid}")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


class _Serving:
    """The server's loop: a rank forked per client; its end sent back to that client."""

    def __init__(self, listener, alive: int, base_path, load_env, directory):
        self.listener, self.alive, self.base_path = listener, alive, base_path
        self.load_env, self.directory = load_env, directory
        self.clients: Dict[int, socket.socket] = {}     # rank pid -> its client's socket

    def serve(self) -> None:
        for name in PRELOAD:
            __import__(name)
        gc.freeze()                    # what the ranks share stays shared
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.fds = [wake_r, wake_w, self.alive]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(self.alive, selectors.EVENT_READ, "alive")
        self.sel.register(wake_r, selectors.EVENT_READ, "wake")
        while True:
            for key, _ in self.sel.select():
                if key.data == "accept":
                    self.accept()
                elif key.data == "alive":      # the agent is done: so are its ranks
                    for pid in list(self.clients):
                        _kill(pid)
                    self.reap(block=True)
                    return
                elif key.data == "wake":
                    os.read(wake_r, 512)
                elif not key.fileobj.recv(1):  # a client is gone: its rank goes too
                    self.sel.unregister(key.fileobj)
                    _kill(key.data)
            self.reap(block=False)

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            header, fds, _, _ = socket.recv_fds(conn, 8, 3)
            request = json.loads(_receive(conn, struct.unpack("!Q", header)[0]))
        except (OSError, ValueError, struct.error):
            conn.close()
            return
        if (not forkable(request["argv"], request["cwd"])
                or differs_at_load(self.load_env, request["env"])):
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(rank_client.REPLY.pack(b"x", 0))
            conn.close()
            return
        client_pid = struct.unpack("3i", conn.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
        pid = os.fork()
        if pid == 0:
            fresh_rank.become(request, fds, self.base_path,
                              close=lambda: (conn.close(), self.close_in_rank()))
        self.clients[pid] = conn
        for fd in fds:
            os.close(fd)
        try:
            record = os.path.join(self.directory, f"rank_of_{client_pid}")
            with open(record + ".tmp", "w") as f:
                f.write(str(pid))
            os.replace(record + ".tmp", record)
            conn.sendall(rank_client.REPLY.pack(b"p", pid))
            self.sel.register(conn, selectors.EVENT_READ, pid)
        except OSError:                # the client is gone already: so goes its rank
            _kill(pid)

    def reap(self, block: bool) -> None:
        while self.clients:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.clients.pop(pid, None)
            if conn is None:
                continue
            try:
                conn.sendall(rank_client.REPLY.pack(b"e", os.waitstatus_to_exitcode(status)))
            except OSError:
                pass
            if conn.fileno() in self.sel.get_map():
                self.sel.unregister(conn)
            conn.close()

    def close_in_rank(self) -> None:
        """In a rank just forked: drop every file the server holds."""
        signal.set_wakeup_fd(-1)
        self.sel.close()               # the epoll file only: nothing unregistered
        for sock in [self.listener, *self.clients.values()]:
            sock.close()
        for fd in self.fds:
            os.close(fd)


def forkable(argv: List[str], cwd: str) -> bool:
    """``-u script ...`` (a script that exists: else Python's own message) or
    ``-u -m module ...``: what torchrun starts."""
    if len(argv) < 2 or argv[0] != "-u":
        return False
    if argv[1] == "-m":
        return len(argv) >= 3
    return not argv[1].startswith("-") and os.path.isfile(os.path.join(cwd, argv[1]))


def _receive(conn, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(min(n - len(data), 1 << 16))
        if not chunk:
            raise OSError("the client went away")
        data += chunk
    return bytes(data)


def _kill(pid: int) -> None:
    rank_client.signal_rank(pid, signal.SIGKILL)
