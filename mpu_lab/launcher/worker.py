"""The worker side of the launcher, used inside a ``launch/`` script under torchrun:
:func:`report` hands a JSON-able result back to :func:`mpu_lab.launcher.run`,
:func:`gather_lines` collects every rank's text on rank 0 in rank order, and :func:`entrypoint`
decorates a script's ``main`` with torch elastic's ``@record`` plus this lab's failure records
(precise failure time, ranks that returned, a stack dump on SIGTERM) that the launcher's
:mod:`~mpu_lab.launcher.diagnosis` reads. The lab's own; Megatron leaves this to torchrun."""
from __future__ import annotations

import faulthandler
import functools
import json
import os
import pathlib
import re
import signal
import sys
import time
import traceback
from typing import Any

from mpu_lab.launcher.paths import RESULT_DIR_ENV


def report(obj: Any) -> Any:
    """Hand ``obj`` (JSON-able) back to :func:`run` from inside a worker. Returns ``obj``.

    Without the launcher (a plain ``torchrun`` call) it does nothing, so scripts run either way.
    A later call replaces an earlier one.
    """
    directory = os.environ.get(RESULT_DIR_ENV)
    if directory:
        rank = int(os.environ.get("RANK", "0"))
        path = pathlib.Path(directory) / f"rank{rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(obj))
        tmp.replace(path)   # atomic: the launcher never reads half a file
    return obj


def gather_lines(text: str):
    """Every rank's ``text``, in rank order, on rank 0 (``None`` on the others).

    A collective: every rank of the world calls it. Printing what it returns on rank 0 gives
    deterministic multi-rank output (what nbval compares), unlike ranks printing at will.
    """
    # Imported here: the launcher imports only the standard library at import time (the
    # notebook's driver, tests/mp/tiny_job.py); a worker that gathers lines has torch anyway.
    import torch
    import torch.distributed as dist

    from mpu_lab.core import comm  # keeps the launcher free of torch at import time
    from mpu_lab.core.utils import get_device  # likewise
    device = get_device()
    data = torch.tensor(list(text.encode()) or [0], dtype=torch.uint8, device=device)
    longest = comm.all_reduce(torch.tensor([data.numel()], device=device), op=dist.ReduceOp.MAX)
    padded = torch.zeros(int(longest.item()), dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    rows = comm.all_gather(padded.unsqueeze(0))                   # [world, longest]
    if dist.get_rank() != 0:
        return None
    return [bytes(row.tolist()).rstrip(b"\0").decode() for row in rows.cpu()]


# A thread's heading in a faulthandler dump of every thread ("Current thread 0x7f... (most
# recent call first):" for the one that took the signal, "Thread 0x7f...:" for the others).
THREAD_HEADING = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+.*$", re.M)
_THREAD_ID = re.compile(r"0x[0-9a-f]+")
# A frame of a faulthandler dump: File "x.py", line 3 in f (no comma, unlike a traceback).
FAULTHANDLER_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def main_thread_stack(text: str) -> str:
    """The main thread's part of a faulthandler dump of every thread: the last one (CPython
    lists a process's threads newest first). A second signal can append a second dump, which a
    thread's id heading a second time begins; the main thread is then the first dump's last
    one, read from the second dump where that one got as far, else from the first. A dump of
    one thread is returned as it is."""
    heads = [m.group(0) for m in THREAD_HEADING.finditer(text)]
    parts = THREAD_HEADING.split(text)        # parts[k + 1] follows heads[k]
    ids = [_THREAD_ID.search(h).group(0) for h in heads]
    first_end = next((k for k in range(1, len(ids)) if ids[k] in ids[:k]), len(ids))
    if first_end == 0:
        return parts[-1]
    main = ids[first_end - 1]
    return [parts[k + 1] for k in range(len(ids)) if ids[k] == main][-1]


def _dump_stack_on_sigterm(directory: str, rank: int) -> None:
    """When torchrun (or :func:`kill_tree`) stops this rank with SIGTERM, write where its main
    thread was to ``stack_rank<r>.txt`` first (``faulthandler``: works even inside a blocked
    C++ collective), then terminate as SIGTERM would. That is how a failure report can say
    where a rank that never joined a collective was stuck.

    Every thread is dumped: the kernel may hand a process's SIGTERM to any of its threads
    (gloo's, torch's), and a dump of only the thread that took it then says nothing of the
    main one. :func:`main_thread_stack` reads the main thread's."""
    try:
        f = open(pathlib.Path(directory) / f"stack_rank{rank}.txt", "w")
        faulthandler.register(signal.SIGTERM, file=f, all_threads=True, chain=True)
    except (OSError, AttributeError, ValueError, RuntimeError):
        pass   # no faulthandler.register (Windows) or no result folder: report less


def entrypoint(fn):
    """Decorate a ``launch/`` script's ``main``: torch elastic's ``@record`` (the traceback goes
    to torchrun's error file) plus a precise failure time, so :func:`run` can tell the rank
    that failed first from the ranks that failed because a peer died; a record of ranks that
    returned, and a stack dump of ranks stopped by SIGTERM (where a hung rank was).

    Under torchrun a rank that raised exits at once (``os._exit(1)``, after the error file and
    the traceback are written): interpreter teardown with a live process group can take a
    second or block on dead peers, and the job's other ranks wait for it."""
    from torch.distributed.elastic.multiprocessing.errors import record   # torch: see above

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        directory = os.environ.get(RESULT_DIR_ENV)
        rank = int(os.environ.get("RANK", "0"))
        if directory:
            _dump_stack_on_sigterm(directory, rank)
        try:
            out = fn(*args, **kwargs)
        except BaseException as exc:
            if directory and not isinstance(exc, SystemExit):
                info = {"time": time.time(), "rank": rank,
                        "message": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()}
                (pathlib.Path(directory) / f"failed_rank{rank}.json").write_text(json.dumps(info))
            raise
        if directory:
            (pathlib.Path(directory) / f"finished_rank{rank}.json").write_text(
                json.dumps({"time": time.time(), "rank": rank}))
        return out

    recorded = record(wrapper)

    @functools.wraps(fn)
    def exit_promptly(*args, **kwargs):
        try:
            return recorded(*args, **kwargs)
        except SystemExit:
            raise
        except BaseException:
            if "TORCHELASTIC_RUN_ID" not in os.environ:   # called in-process (a test): raise
                raise
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    return exit_promptly
