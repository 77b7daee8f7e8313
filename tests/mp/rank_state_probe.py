"""torchrun worker for tests/launcher/test_rank_server.py: reports what a rank sees of its own
interpreter, so that a forked rank can be compared with one started as ``python -u``.

RAISE=r makes rank r raise after an ``atexit`` handler and a thread that prints are set up;
KILL_SELF=N makes rank 0 end by signal N, and the others wait to be stopped; EXIT=c makes rank 0
call ``sys.exit(c)``, INTERRUPT=1 raise ``KeyboardInterrupt`` (the others wait to be stopped);
AWAIT_SIGTERM=1 makes rank 0 raise while rank 1 waits for torchrun's SIGTERM, which its handler
reports. Every rank leaves a thread pool open with a task done, as a script may (the
interpreter's exit closes it).
"""
import atexit
import gc
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from mpu_lab import launcher


def state() -> dict:
    package = sys.modules["mpu_lab"]
    return {
        "argv": sys.argv,
        "name": __name__,
        "file": __file__,
        "path_head": sys.path[:3],
        "cwd": os.getcwd(),
        "rank": os.environ["RANK"],
        "server_vars": sorted(k for k in os.environ if k in (
            "PYTHON_EXEC", "MPU_LAB_RANK_SERVER", "MPU_LAB_RANK_PYTHON")),
        "threads": torch.get_num_threads(),
        "process": multiprocessing.current_process().name,
        "parent_process": multiprocessing.parent_process() is None,
        "stdout_write_through": sys.stdout.write_through,
        "stdout_fd": sys.stdout.fileno(),
        "gc_threshold": gc.get_threshold()[0],
        "package": os.path.dirname(package.__file__),
        "sitecustomize": os.path.basename(os.path.dirname(sys.modules["sitecustomize"].__file__)),
        "own_session": os.getsid(0) == os.getpid(),
        "signals": [str(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT,
                                                       signal.SIGCHLD, signal.SIGPIPE)],
    }


POOL = ThreadPoolExecutor(1)


def main():
    POOL.submit(print, end="")
    rank = os.environ["RANK"]
    if "EXIT" in os.environ or "INTERRUPT" in os.environ:
        if rank == "0" and "EXIT" in os.environ:
            sys.exit(int(os.environ["EXIT"]))
        if rank == "0":
            raise KeyboardInterrupt
        time.sleep(60)                          # the others wait to be stopped
    if "AWAIT_SIGTERM" in os.environ:
        if rank == "0":
            time.sleep(1.0)
            raise RuntimeError("rank 0 fails while rank 1 waits")
        signal.signal(signal.SIGTERM, lambda *_: (print(f"rank {rank} got SIGTERM", flush=True),
                                                   os._exit(3)))
        time.sleep(60)
    if "KILL_SELF" in os.environ:
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), int(os.environ["KILL_SELF"]))
        time.sleep(60)
    if os.environ.get("RAISE") == os.environ["RANK"]:
        atexit.register(print, f"rank {os.environ['RANK']}: atexit ran")
        threading.Thread(target=lambda: (time.sleep(0.3),
                                         print(f"rank {os.environ['RANK']}: thread joined"))
                         ).start()
        raise ValueError(f"rank {os.environ['RANK']} fails on purpose")
    with open("/proc/self/cmdline") as f:      # a forked rank keeps its server's
        cmdline = f.read().replace("\0", " ")
    launcher.report(dict(state(), cmdline=cmdline, random=random.random()))


if __name__ == "__main__":
    main()
