"""An engine's watch on the process that started its world (a notebook's kernel, a test).

That process stops the world in an exit handler; killed by a signal, it never runs it. Each
engine therefore runs :func:`watch_owner` in a thread of its own: once the owner is gone, it
stops the controller and ends the engine, so that no process of the world outlives its owner.
(A module apart from :mod:`~mpu_lab.labkit.playground.engine`: a stack dump of an engine finds
the thread that runs a cell by that module's frames, and this thread must not look like it.)
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import psutil


def owner_alive(pid: int, started: float) -> bool:
    """Whether process ``pid``, created at ``started`` (psutil's ``create_time``: a PID reused
    by a later process is not it), still runs."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def watch_owner(pid: int, started: float, controller: int, every_s: float = 0.5
                ) -> threading.Thread:
    """A daemon thread of this engine that, once the world's owner is gone (a kernel or a test
    killed by a signal: its exit handler, which stops the world, never ran), stops the
    controller and ends this engine, so that no process of the world outlives it."""
    def watch():
        while owner_alive(pid, started):
            time.sleep(every_s)
        with contextlib.suppress(OSError):
            os.kill(controller, signal.SIGTERM)
        os._exit(0)
    thread = threading.Thread(target=watch, name="mpu_lab-owner-watch", daemon=True)
    thread.start()
    return thread
