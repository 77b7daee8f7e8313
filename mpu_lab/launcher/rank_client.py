"""What torchrun starts for each rank of a job whose ranks are forked (:mod:`rank_server`): a
small interpreter with the standard library only (``python -IS``), in place of
``python -u script.py``. It hands its arguments, working directory, environment and its
standard input, output and error to the job's rank server, which forks the rank from a process
that has torch loaded already; then it stands for that rank towards torchrun: the signals
torchrun sends it go on to the rank, and it ends the way the rank ended (its exit code, or the
signal that killed it). Where the server cannot take the rank (it is gone, or the environment
asks for something a fork cannot give), it becomes ``python`` with the same arguments
(``os.execve``), exactly what torchrun would have started.

Run as a program only (torchrun's ``PYTHON_EXEC``); it imports nothing of mpu_lab.
"""
import json
import os
import signal
import socket
import struct
import sys

SERVER_ENV = "MPU_LAB_RANK_SERVER"      # the rank server's socket
PYTHON_ENV = "MPU_LAB_RANK_PYTHON"      # the interpreter a rank runs
OURS = (SERVER_ENV, PYTHON_ENV, "PYTHON_EXEC")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
REPLY = struct.Struct("!cq")            # b"p" the rank's pid, b"x" run as a program,
                                        # b"e" how the rank ended (exit code, -N for signal N)


def rank_environment() -> dict:
    """This process's environment without the variables that point at the rank server."""
    return {k: v for k, v in os.environ.items() if k not in OURS}


def run_as_program(argv):
    python = os.environ.get(PYTHON_ENV) or sys.executable
    os.execve(python, [python, *argv], rank_environment())


def signal_rank(pid: int, signum: int) -> None:
    """Signal the rank's session (its own, as torchrun gives each worker), or the rank alone
    in the moment before it made that session."""
    for send in (os.killpg, os.kill):
        try:
            send(pid, signum)
            return
        except ProcessLookupError:
            pass


def receive(sock):
    data = b""
    while len(data) < REPLY.size:
        chunk = sock.recv(REPLY.size - len(data))
        if not chunk:
            return None, None
        data += chunk
    return REPLY.unpack(data)


def end_like(code: int):
    """Exit with ``code``, or die of the signal a negative ``code`` names."""
    sys.stdout.flush()
    if code >= 0:
        os._exit(code)
    try:
        signal.signal(-code, signal.SIG_DFL)
    except (OSError, ValueError):             # SIGKILL, SIGSTOP: no handler to reset
        pass
    os.kill(os.getpid(), -code)
    os._exit(128 - code)


def main(argv):
    address = os.environ.get(SERVER_ENV)
    if not address:
        run_as_program(argv)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
    except OSError:
        run_as_program(argv)
    rank = {"pid": None, "pending": []}

    def forward(signum, frame):
        if rank["pid"] is None:
            rank["pending"].append(signum)
            return
        signal_rank(rank["pid"], signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    request = json.dumps({"argv": argv, "cwd": os.getcwd(),
                          "env": rank_environment()}).encode()
    socket.send_fds(sock, [struct.pack("!Q", len(request))], [0, 1, 2])
    sock.sendall(request)
    kind, value = receive(sock)
    if kind == b"p":
        rank["pid"] = value
        for signum in rank["pending"]:
            forward(signum, None)
        kind, value = receive(sock)
        if kind == b"e":
            end_like(value)
        signal_rank(rank["pid"], signal.SIGKILL)   # the server is gone: so is its rank
        print(f"mpu_lab rank server: gone before rank {os.environ.get('RANK')} ended",
              file=sys.stderr)
        os._exit(1)
    sock.close()
    if rank["pending"]:                       # stopped before it started
        end_like(-rank["pending"][0])
    run_as_program(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
