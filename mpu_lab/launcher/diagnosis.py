"""Explaining a failed torchrun job: the root-cause rank and its traceback (from
:func:`~mpu_lab.launcher.worker.entrypoint`'s records, else torch elastic's error files), the
collective a traceback ended in, where every other rank was (its failure, its return, its stack
dump on SIGTERM, its exit code in torchrun's summary), and a collective timeout or a lost peer
told apart from the first failure (the lab's own; Megatron leaves this to torchrun)."""
from __future__ import annotations

import json
import pathlib
import re
import sysconfig
from typing import Dict, List, Optional, Tuple

from mpu_lab.launcher.paths import REPO_ROOT
from mpu_lab.launcher.worker import main_thread_stack

# Frames in the launcher's own files (the entrypoint's wrappers) are not the user's code.
_LAUNCHER_DIR = pathlib.Path(__file__).resolve().parent

# Messages of ranks that fail only because another rank died first.
SECONDARY_FAILURE = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|"
                               r"NCCL communicator was aborted|failed to recv|Socket Timeout",
                               re.I)



def root_cause(log_dir: pathlib.Path, result_dir: pathlib.Path) -> Tuple[Optional[int], str, str]:
    """(rank, message, traceback) of the first failure: from :func:`entrypoint`'s precise
    records if any, else from torch elastic's error files (``@record``, 1 s resolution, so
    ties are broken against errors that only echo a dead peer)."""
    precise = []
    for path in result_dir.glob("failed_rank*.json"):
        try:
            precise.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if precise:
        first = min(precise, key=lambda d: (bool(SECONDARY_FAILURE.search(d["message"])),
                                            d["time"]))
        return first["rank"], first["message"], first["traceback"]
    best = None
    for path in log_dir.rglob("error.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        message = data.get("message", {})
        if isinstance(message, str):
            text, extra = message, {}
        else:
            text, extra = message.get("message", ""), message.get("extraInfo", {})
        stamp = float(extra.get("timestamp", 0) or 0)
        # torchrun writes per-worker folders named by local rank (== global rank, one node)
        try:
            rank = int(path.parent.name)
        except ValueError:
            rank = None
        key = (stamp, bool(SECONDARY_FAILURE.search(text)))
        if best is None or key < best[0]:
            best = (key, rank, text, extra.get("py_callstack", ""))
    if best is None:
        return None, "", ""
    return best[1], best[2], best[3]


# gloo: "Timed out waiting 5000ms for recv operation"; NCCL's watchdog: "Watchdog caught
# collective operation timeout: WorkNCCL(... Timeout(ms)=...) ran for ... milliseconds".
_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting|operation timeout|Timeout\(ms\)", re.I)
# TORCH_DISTRIBUTED_DEBUG=DETAIL's check of the ranks' calls before each collective.
_DETAIL_MISMATCH = re.compile(r"Detected mismatch between collectives", re.I)
# A traceback frame (File "x.py", line 3, in f) or a faulthandler one (File "x.py", line 3 in f).
_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')
_C10D_FILES = ("distributed_c10d.py",)
_P2P_OPS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
_COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
             "all_to_all_with_splits", "send_recv")
# mpu_lab's thin wrapper around torch.distributed: its frames say nothing about who called it.
_PLUMBING = tuple((pathlib.Path(__file__).resolve().parent.parent / "core" / "comm").glob("*.py"))
_SIGNALS = {6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}


# Python's own library: a rank stopped while torch logs its exception stands in ``logging``;
# its place is the line of ours that called torch.
_STDLIB = tuple({pathlib.Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")})


def _in_stdlib(p: pathlib.Path) -> bool:
    return (not INSTALLED_DIRS.intersection(p.parts)
            and any(p.is_relative_to(d) for d in _STDLIB))


def _own_frames(text: str) -> List[Tuple[str, int, str]]:
    """``(file, line, function)`` of the frames of ``text`` (a traceback, outermost first,
    or a faulthandler dump, innermost first) that are neither torch's, Python's own library's,
    this launcher's nor :mod:`mpu_lab.core.comm`'s (so a place is the line that called the
    collective, or the library function)."""
    out = []
    for path, line, func in _FRAME.findall(text):
        p = pathlib.Path(path).resolve()
        if "torch" in p.parts or p.parent == _LAUNCHER_DIR or p in _PLUMBING or _in_stdlib(p):
            continue
        out.append((path, int(line), func))
    return out


# Where installed packages live: a file there is never the repository's, even where the
# virtual environment sits inside the repository (the README's ``.venv``).
INSTALLED_DIRS = frozenset({"site-packages", "dist-packages"})


def repo_relative(path: str) -> Optional[str]:
    """``path`` relative to the repository where it is one of the repository's own files;
    None for anything else, an installed package included."""
    p = pathlib.Path(path)
    if INSTALLED_DIRS.intersection(p.parts):
        return None
    try:
        return str(p.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return None


def short_path(path: str) -> str:
    """A frame's file: relative to the repository for its own files, else the file name."""
    return repo_relative(path) or pathlib.Path(path).name


def _collective_in(traceback_text: str) -> Optional[str]:
    """The ``torch.distributed`` call a traceback ended in (``all_reduce``, ``barrier``...), or,
    for a collective started asynchronously and failed in its ``wait()``, the
    :mod:`mpu_lab.core.comm` function that started it (``all_reduce_async`` -> ``all_reduce``)."""
    frames = _FRAME.findall(traceback_text)
    ops = [func for path, _, func in frames
           if pathlib.Path(path).name in _C10D_FILES and func != "wrapper"]
    if ops:
        return ops[-1]
    ours = [func.removesuffix("_async") for path, _, func in frames
            if pathlib.Path(path).resolve() in _PLUMBING]
    return next((op for op in ours if op in _COMM_OPS), None)


def _torch_call(traceback_text: str) -> Optional[str]:
    """The innermost torch function of a traceback (a collective torch issues itself, e.g.
    DistributedDataParallel's ``_pre_forward``), as ``function (torch/file.py)``."""
    frames = [(path, func) for path, _, func in _FRAME.findall(traceback_text)
              if "torch" in pathlib.Path(path).parts]
    if not frames:
        return None
    path, func = frames[-1]
    parts = pathlib.Path(path).parts
    return f"{func} ({'/'.join(parts[len(parts) - 1 - parts[::-1].index('torch'):])})"


def where_in(text: str, innermost_last: bool = True) -> str:
    """The place a traceback (innermost last) or a faulthandler dump (``innermost_last=False``)
    stands at: the innermost frame of the repository's own code, as ``file:line in function``."""
    frames = _own_frames(text)
    if frames:
        path, line, func = frames[-1] if innermost_last else frames[0]
        return f"{short_path(path)}:{line} in {func}"
    every = _FRAME.findall(text)    # torch's or the launcher's frames only: name the innermost
    if every:
        path, line, func = every[-1] if innermost_last else every[0]
        return (f"an unknown place (no frame of its own; innermost {short_path(path)}:{line} "
                f"in {func})")
    first = text.strip().splitlines()[0][:60] if text.strip() else "empty"
    return f"an unknown place (its dump has no frame: {first!r})"


def _rank_facts(result_dir: pathlib.Path, nproc: int, exit_codes: Dict[int, int]
                ) -> Dict[int, Dict[str, object]]:
    """Per rank: ``how`` it ended (raised, finished, stopped, aborted, exited, killed,
    unknown), ``where`` (file:line in function), ``message`` and ``op`` (the collective its
    traceback or stack dump was in)."""
    facts: Dict[int, Dict[str, object]] = {}
    for r in range(nproc):
        code = exit_codes.get(r)
        record, stack = result_dir / f"failed_rank{r}.json", result_dir / f"stack_rank{r}.txt"
        try:
            d = json.loads(record.read_text()) if record.exists() else None
        except (OSError, ValueError):
            d = None
        text = main_thread_stack(stack.read_text()) if stack.exists() else ""
        if d is not None:
            facts[r] = dict(how="raised", where=where_in(d["traceback"]), message=d["message"],
                            op=_collective_in(d["traceback"]), traceback=d["traceback"],
                            time=d.get("time", 0.0))
        elif (result_dir / f"finished_rank{r}.json").exists():
            facts[r] = dict(how="finished")
        elif text.strip():
            facts[r] = dict(how="aborted" if code == -6 else "stopped",
                            where=where_in(text, innermost_last=False), op=_collective_in(text))
        elif code is not None and code > 0:
            facts[r] = dict(how="exited", code=code)
        elif code is not None and code < 0:
            facts[r] = dict(how="aborted" if code == -6 else "killed", code=code,
                            where="an unknown place (no stack dump)")
        else:
            facts[r] = dict(how="unknown")
    return facts


# gloo and c10d prefix a message with the C++ file that raised it, as compiled on the build
# machine: "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] ".
_SOURCE_LOCATION = re.compile(r"\[(?:[^\]\s]*/)?([^\]\s/]+\.(?:cc|cpp|h)):(\d+)\]\s*")
# ...and gloo ends a lost connection with advice for whoever reads its log, the same for every
# cause ("This is typically caused by a remote worker hanging ... GLHF! <emoji>").
_GLOO_ADVICE = re.compile(r"\.?\s*This is typically caused by .*$")


def quote_message(message: str) -> str:
    """The meaningful part of a rank's exception message, for the launcher's one-line report
    of a failed rank: its first line, without the C++ source path (kept as ``(in pair.cc:537)``
    at the end) and without gloo's boilerplate advice. ``RuntimeError: [/__w/.../tcp/pair.cc:537]
    Read error [127.0.0.1]:41175: Connection reset by peer. This is typically caused by ...
    GLHF!`` becomes ``RuntimeError: Read error [127.0.0.1]:41175: Connection reset by peer
    (in pair.cc:537)``. The full message stays in the rank's traceback."""
    text = message.strip().splitlines()[0] if message.strip() else ""
    found = _SOURCE_LOCATION.search(text)
    text = _GLOO_ADVICE.sub("", _SOURCE_LOCATION.sub("", text, count=1)).rstrip(" .")
    return f"{text} (in {found.group(1)}:{found.group(2)})" if found else text


def _brief(message: str) -> str:
    """The first sentence of :func:`quote_message` without the source location: what a rank's
    state line says it raised (``Timed out waiting 8000ms for recv operation to complete``)."""
    text = _GLOO_ADVICE.sub("", _SOURCE_LOCATION.sub("", message.strip().splitlines()[0]
                                                     if message.strip() else ""))
    text = re.split(r"(?<=[^.]{20})\. (?=[A-Z])", text)[0]
    return text[:200]


def _state(f: Dict[str, object]) -> str:
    how = f["how"]
    if how == "raised":
        return f"raised at {f['where']}: {_brief(str(f['message']))}"
    if how == "finished":
        return "had returned from main (finished)"
    if how == "stopped":
        inside = f", waiting in {f['op']}" if f.get("op") else ""
        return f"was stopped at {f['where']}{inside}"
    if how == "aborted":
        return f"aborted (SIGABRT, from C++ code such as gloo's checks) at {f['where']}"
    if how == "exited":
        return f"exited with code {f['code']} without a Python exception (os._exit, or killed)"
    if how == "killed":
        return f"was killed by signal {-int(f['code'])}"
    return "was stopped (no record of where)"


def diagnose(result_dir: pathlib.Path, nproc: int, root_message: str, root_tb: str,
              timeout_s: Optional[str], exit_codes: Optional[Dict[int, int]] = None
              ) -> Tuple[str, Dict[int, str]]:
    """Explain a failed job: which call, where, which ranks were in it and where the others
    were, and the likely cause (:func:`_likely_cause`). Returns ``(text, state per rank)``;
    text is empty when there is nothing to add to the root cause's own traceback (no
    collective involved and no traceback)."""
    facts = _rank_facts(result_dir, nproc, exit_codes or {})
    states = {r: _state(f) for r, f in facts.items()}
    op = _collective_in(root_tb)
    place = where_in(root_tb)
    timed_out = bool(_COLLECTIVE_TIMEOUT.search(root_message))
    secondary = bool(SECONDARY_FAILURE.search(root_message))
    waiting = [r for r, f in sorted(facts.items()) if f["how"] == "stopped" and f["op"]]
    if not root_tb and op is None and waiting and any(
            f["how"] in ("aborted", "exited", "killed") for f in facts.values()):
        # No rank raised: one ended without a Python exception (an abort in gloo's checks, an
        # exit code, a signal) and torchrun stopped the others while they waited in a
        # collective before they noticed. Under less load the waiting ranks raise "connection
        # closed by peer" first; either way the collective failed because a peer went away.
        op, place, secondary = facts[waiting[0]]["op"], str(facts[waiting[0]]["where"]), True
    # the root cause's rank: the earliest record with its traceback (ranks may fail alike)
    same = [r for r, f in facts.items() if f["how"] == "raised" and root_tb
            and f["traceback"].strip() == root_tb.strip()]
    root = min(same, key=lambda r: facts[r]["time"]) if same else None
    if op is None and not (timed_out or secondary):
        # an exit code of its own first: a signal is more often torchrun stopping a peer
        gone = ([r for r, f in sorted(facts.items()) if f["how"] == "exited"]
                + [r for r, f in sorted(facts.items()) if f["how"] == "killed"])
        if root is not None:
            first = root
            head = f"Rank {root} raised in its own code at {where_in(root_tb)}, not in a collective."
        elif not root_tb and gone:
            # No rank raised and none was waiting in a collective: one ended on its own (an
            # exit code, a signal) while the others were still in their own code.
            first = gone[0]
            head = f"No rank raised: rank {first} {states[first]}."
        else:
            return "", states
        others = [r for r in range(nproc) if r != first]
        lines = [head]
        if others:
            lines.append("The others: " + "; ".join(f"rank {r} {states[r]}" for r in others) + ".")
        lines.append("likely cause: " + _likely_cause(facts, root, op, root_message, place))
        return "\n".join(lines), states
    # in it: the ranks that raised in it and those torchrun stopped while they waited in it
    in_op = sorted(r for r, f in facts.items() if f["how"] in ("raised", "stopped")
                   and f["op"] == op and f["where"] == place)
    absent = [r for r in range(nproc) if r not in in_op]
    what = op or (f"a collective inside {_torch_call(root_tb)}" if _torch_call(root_tb)
                  else "a collective")
    if timed_out:
        limit = f"{timeout_s} s" if timeout_s else "default 60 s"
        head = f"A collective timed out (MPU_LAB_TIMEOUT_S: {limit}): {what} at {place}"
    elif secondary:
        head = f"A collective failed because a peer went away: {what} at {place}"
    else:
        head = f"A collective failed: {what} at {place}"
    lines = [f"{head}, reached by rank(s) {in_op}; every rank must call it, in the same order."]
    if absent:
        lines.append("Not in it: " + "; ".join(f"rank {r} {states[r]}" for r in absent) + ".")
    lines.append("likely cause: " + _likely_cause(facts, root, op, root_message, place))
    return "\n".join(lines), states


def _names(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _likely_cause(facts: Dict[int, Dict[str, object]], root: Optional[int], op: Optional[str],
                  root_message: str, place: str) -> str:
    """One sentence from what the ranks' records show (never from knowing what went wrong):
    a rank that raised on its own, one that aborted, exited or returned early, one stuck
    outside the collective, ranks waiting in different collectives, or all in the same one.
    ``place``: where the failed collective was called (``file:line in function``)."""
    by = {how: sorted(r for r, f in facts.items() if f["how"] == how)
          for how in ("raised", "finished", "stopped", "aborted", "exited", "killed")}
    if _DETAIL_MISMATCH.search(root_message):
        return ("TORCH_DISTRIBUTED_DEBUG=DETAIL found the ranks calling different collectives "
                "here (another operation, shape or dtype: the message lists each rank's call); "
                "every rank must pass the same collective the same tensor shape and dtype.")
    own = [r for r in by["raised"] if facts[r]["op"] is None and not SECONDARY_FAILURE.search(
        str(facts[r]["message"])) and not _COLLECTIVE_TIMEOUT.search(str(facts[r]["message"]))]
    if own:
        r = root if root in own else own[0]
        kind = str(facts[r]["message"]).split(":")[0]
        return (f"rank {r} raised {kind} in its own code at {facts[r]['where']}; the other "
                f"ranks failed only because it went away, so fix rank {r}'s error first.")
    if by["aborted"]:
        r = by["aborted"][0]
        if facts[r]["where"] == place or "unknown" in str(facts[r]["where"]):
            return (f"{_names(by['aborted'])} aborted inside the collective: gloo checks that each "
                    f"message has the size its receiver expects ('Received data size doesn't "
                    f"match expected size' on that rank's stderr), so the ranks passed tensors "
                    f"of different sizes to the same collective.")
        return (f"rank {r} aborted in a collective at {facts[r]['where']} while others were in "
                f"another one at {place}: gloo paired two different calls (a rank that skips "
                f"a collective or calls them in another order sends messages the others do "
                f"not expect) and its size check failed.")
    if by["exited"] or by["killed"]:
        r = (by["exited"] + by["killed"])[0]
        how = (f"exited with code {facts[r]['code']}" if facts[r]["how"] == "exited"
               else f"was killed by signal {-int(facts[r]['code'])}")
        return (f"rank {r} {how} without a Python exception (an os._exit or sys.exit in a "
                f"library, or the operating system killed it: out of memory? see dmesg), and "
                f"the others then lost their peer.")
    if by["finished"]:
        return (f"{_names(by['finished'])} returned from main without entering this collective: "
                f"a collective that only some ranks call (a rank-dependent `if`, or a loop "
                f"that runs more steps on some ranks) leaves the others waiting for it.")
    stuck = [r for r in by["stopped"] if facts[r]["op"] is None]
    if stuck:
        return (f"{_names(stuck)} never reached the collective: when the job was stopped "
                f"{'it was' if len(stuck) == 1 else 'they were'} still in {facts[stuck[0]]['where']}"
                f" (a hang: a sleep, a lock, slow I/O, an endless loop, or far more work than "
                f"the others), and the others waited until the timeout.")
    places: Dict[str, List[int]] = {}
    for r, f in sorted(facts.items()):
        if f["how"] in ("raised", "stopped"):
            places.setdefault(str(f["where"]), []).append(r)
    if len(places) > 1:
        where = "; ".join(f"{_names(rs)} at {p}" for p, rs in places.items())
        return (f"the ranks wait in different collectives ({where}): they called collectives "
                f"in another order or number "
                f"(a skipped or an extra one) or on another process group; every rank of a "
                f"group must make the same calls on it, in the same order.")
    if op in _P2P_OPS:
        return (f"every rank is blocked in {op} at {place}: two ranks that both send first "
                f"(or both receive first) wait for each other forever; post each send with its "
                f"receive (batch_isend_irecv), as Megatron's p2p_communication does.")
    return (f"every rank reached the same {op or 'collective'} at {place} and it still did not "
            f"complete: the ranks disagree on what it carries (a tensor of another size or "
            f"dtype) or on its process group; TORCH_DISTRIBUTED_DEBUG=DETAIL compares the "
            f"ranks' calls.")


def traceback_from_lines(lines, rank) -> str:
    mine = [t for r, t in lines if r == rank]
    for i, text in enumerate(mine):
        if text.startswith("Traceback (most recent call last)"):
            return "\n".join(mine[i:])
    return "\n".join(mine[-30:])


def exit_codes_from_lines(lines) -> Dict[int, int]:
    """``{rank: exit code}`` from torchrun's failure summary (``rank : 1 (local_rank: 1)``
    then ``exitcode : 3 (pid: ...)``); negative codes are signals (-15: SIGTERM)."""
    codes, rank = {}, None
    for r, text in lines:
        if r is not None:
            continue
        m = re.search(r"\brank\s*:\s*(\d+)\s*\(local_rank", text)
        if m:
            rank = int(m.group(1))
            continue
        m = re.search(r"\bexitcode\s*:\s*(-?\d+)", text)
        if m and rank is not None:
            codes.setdefault(rank, int(m.group(1)))
            rank = None
    return codes


def first_failed_rank(lines) -> Optional[int]:
    """Parse torchrun's failure summary as a fallback: the rank under its "Root Cause (first
    observed failure)" heading, else the first one it lists (``rank : 3 (local_rank: 3)``)."""
    summary = [text for r, text in lines if r is None]
    for start in ([i for i, t in enumerate(summary) if "Root Cause" in t][-1:] + [0]):
        for text in summary[start:]:
            m = re.search(r"\brank\s*:\s*(\d+)\s*\(local_rank", text)
            if m:
                return int(m.group(1))
    for r, text in lines:
        if r is not None and text.startswith("Traceback"):
            return r
    return None
