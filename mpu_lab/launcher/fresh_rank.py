"""What a rank forked by :mod:`mpu_lab.launcher.rank_server` does to become what
``python -u script.py`` (or ``python -u -m module``) would have been, and to end as it would.

Set up as a fresh interpreter sets itself up: ``sys.argv``; ``sys.path`` (the script's
directory, the job's ``PYTHONPATH``, then the installation's paths); the environment,
directory, standard streams (unbuffered, as ``-u``) and signal dispositions; a session of its
own (as torchrun starts a worker); none of this package's modules loaded (a job imports the
checkout on its ``PYTHONPATH``); ``tempfile``'s directory and numpy's seed drawn again
(Python's ``random`` reseeds itself after a fork); ``OMP_NUM_THREADS`` applied; multiprocessing
seeing a main process; the job's ``sitecustomize`` run. Ended as the interpreter ends:
threading's exit hooks, other threads joined, ``atexit`` handlers, streams flushed; an uncaught
exception printed from the script's own frames with exit code 1, ``KeyboardInterrupt`` by
SIGINT, ``sys.exit(code)`` with ``code & 0xFF``.

What a fork cannot give: the hash seed of ``str`` is the server's for every rank (so set
iteration order agrees across ranks, where fresh interpreters could differ), and warnings a
module gave while the server loaded it are not given again.
"""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import io
import os
import runpy
import signal
import site
import sys
import sysconfig
import tempfile
import threading
import traceback
from typing import Callable, List, NoReturn, Optional


def become(request, fds: List[int], base_path: List[str], close: Callable[[], object]
           ) -> NoReturn:
    """In a rank just forked by the rank server: ``close`` the server's files, become
    ``python -u script ...`` as ``request`` (argv, cwd, env) and ``fds`` (its standard input,
    output and error) describe, run it, exit as it ended."""
    try:
        close()
        os.setsid()                    # as torchrun starts a worker: a session of its own
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                       signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"][1:]
        module = argv[1] if argv[0] == "-m" else None
        _fresh_interpreter_state(module, argv, base_path)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    try:
        _exit(_run_main(module, argv))
    finally:                           # never back into the server's code
        os._exit(1)


def _fresh_interpreter_state(module: Optional[str], argv: List[str], base_path) -> None:
    keep = {os.path.realpath(sysconfig.get_paths()[k]) + os.sep
            for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    for name, mod in list(sys.modules.items()):
        top = name.partition(".")[0]
        origin = getattr(mod, "__file__", None)
        if top in ("mpu_lab", "sitecustomize", "usercustomize", "__mp_main__") or (
                origin and not os.path.realpath(origin).startswith(tuple(keep))):
            del sys.modules[name]
    first = os.getcwd() if module else os.path.dirname(os.path.realpath(argv[0]))
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path: List[str] = []
    for p in [first, *extra, *base_path]:
        if p not in path:
            path.append(p)
    sys.path[:] = path
    sys.argv = list(argv[2:] if module else argv)
    encoding = os.environ.get("PYTHONIOENCODING", "").partition(":")[0] or sys.stdout.encoding
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding=encoding, write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding=encoding, errors="backslashreplace",
        write_through=True)
    tempfile.tempdir = None           # found again from this environment's TMPDIR
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    _a_main_process()
    if "numpy" in sys.modules:        # its own seed, as a fresh interpreter draws one
        sys.modules["numpy"].random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    site.execsitecustomize()          # the job's, as ``site`` runs it at start-up


def _a_main_process() -> None:
    """multiprocessing's view of this process: a main process (as in a fresh interpreter), not
    the agent's child; its own resource tracker, started when first needed."""
    import multiprocessing.process as mp_process
    import multiprocessing.resource_tracker as tracker
    main = mp_process.current_process()
    main._identity, main._name, main._parent_pid, main._popen = (), "MainProcess", None, None
    main._config = {"authkey": mp_process.AuthenticationString(os.urandom(32)),
                    "semprefix": "/mp"}
    for fd in (getattr(mp_process._parent_process, "_sentinel", None),
               getattr(tracker._resource_tracker, "_fd", None)):
        if isinstance(fd, int):
            with contextlib.suppress(OSError):
                os.close(fd)
    mp_process._parent_process = None
    mp_process._children = set()
    tracker._resource_tracker._fd = tracker._resource_tracker._pid = None


def _run_main(module: Optional[str], argv: List[str]) -> int:
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return (exc.code or 0) & 0xFF      # sys.exit(-1): 255, as Python exits
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in _OUR_FILES:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        return -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1


_OUR_FILES = {__file__, runpy.__file__, "<frozen runpy>"}


def _exit(code: int) -> None:
    """End as the interpreter ends: threading's exit hooks run and other threads joined,
    ``atexit`` handlers run, streams flushed, then the exit code (or, for a negative code, the
    signal it names: SIGINT after a ``KeyboardInterrupt``)."""
    threading._shutdown()             # what the interpreter runs first at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)
