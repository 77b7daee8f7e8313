"""Explaining a failed torchrun job: the root-cause rank and its traceback (from
:func:`~mpu_lab.launcher.worker.entrypoint`'s records, else torch elastic's error files), the
collective a traceback ended in, where every other rank was (its failure, its return, its stack
dump on SIGTERM, its exit code in torchrun's summary), and a collective timeout or a lost peer
told apart from the first failure (the lab's own; Megatron leaves this to torchrun)."""
from __future__ import annotations

import json
import pathlib
import re
from typing import Dict, List, Optional, Tuple

from mpu_lab.launcher.paths import REPO_ROOT

# Frames in the launcher's own files (the entrypoint's wrappers) are not the user's code.
_LAUNCHER_DIR = pathlib.Path(__file__).resolve().parent

# Messages of ranks that fail only because another rank died first.
_SECONDARY = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|"
                        r"NCCL communicator was aborted|failed to recv|Socket Timeout", re.I)



def _root_cause(log_dir: pathlib.Path, result_dir: pathlib.Path) -> Tuple[Optional[int], str, str]:
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
        first = min(precise, key=lambda d: (bool(_SECONDARY.search(d["message"])), d["time"]))
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
        key = (stamp, bool(_SECONDARY.search(text)))
        if best is None or key < best[0]:
            best = (key, rank, text, extra.get("py_callstack", ""))
    if best is None:
        return None, "", ""
    return best[1], best[2], best[3]


# gloo: "Timed out waiting 5000ms for recv operation"; NCCL's watchdog: "Watchdog caught
# collective operation timeout: WorkNCCL(... Timeout(ms)=...) ran for ... milliseconds".
_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting|operation timeout|Timeout\(ms\)", re.I)
# A traceback frame (File "x.py", line 3, in f) or a faulthandler one (File "x.py", line 3 in f).
_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')
_C10D_FILES = ("distributed_c10d.py",)


def _own_frames(text: str) -> List[Tuple[str, int, str]]:
    """``(file, line, function)`` of the frames of ``text`` (a traceback, outermost first,
    or a faulthandler dump, innermost first) that are neither torch's nor this launcher's."""
    out = []
    for path, line, func in _FRAME.findall(text):
        p = pathlib.Path(path)
        if "torch" in p.parts or p.resolve().parent == _LAUNCHER_DIR:
            continue
        out.append((path, int(line), func))
    return out


def _short(path: str) -> str:
    try:
        return str(pathlib.Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return pathlib.Path(path).name


def _collective_in(traceback_text: str) -> Optional[str]:
    """The ``torch.distributed`` call a traceback ended in (``all_reduce``, ``barrier``...)."""
    ops = [func for path, _, func in _FRAME.findall(traceback_text)
           if pathlib.Path(path).name in _C10D_FILES and func != "wrapper"]
    return ops[-1] if ops else None


def _where(text: str, innermost_last: bool = True) -> str:
    frames = _own_frames(text)
    if not frames:
        return "an unknown place"
    path, line, func = frames[-1] if innermost_last else frames[0]
    return f"{_short(path)}:{line} in {func}"


def _diagnose(result_dir: pathlib.Path, nproc: int, root_message: str, root_tb: str,
              timeout_s: Optional[str], exit_codes: Optional[Dict[int, int]] = None
              ) -> Tuple[str, Dict[int, str]]:
    """Explain a job that died in a collective: which call, where, which ranks were in it and
    where the others were. Returns ``(text, state per rank)``; text is empty when the root
    cause was no collective problem."""
    states: Dict[int, str] = {}
    failed = {}
    for path in result_dir.glob("failed_rank*.json"):
        try:
            d = json.loads(path.read_text())
            failed[d["rank"]] = d
        except (OSError, ValueError, KeyError):
            continue
    for r in range(nproc):
        if r in failed:
            msg = failed[r]["message"].splitlines()[0] if failed[r]["message"] else ""
            states[r] = f"raised at {_where(failed[r]['traceback'])}: {msg[:160]}"
        elif (result_dir / f"finished_rank{r}.json").exists():
            states[r] = "had returned from main (finished)"
        else:
            stack = result_dir / f"stack_rank{r}.txt"
            text = stack.read_text() if stack.exists() else ""
            code = (exit_codes or {}).get(r)
            if text.strip():
                states[r] = f"was stopped at {_where(text, innermost_last=False)}"
            elif code is not None and code > 0:
                states[r] = (f"exited with code {code} without a Python exception (os._exit, "
                             f"or killed)")
            elif code is not None and code < 0:
                states[r] = f"was killed by signal {-code}"
            else:
                states[r] = "was stopped (no record of where)"
    op = _collective_in(root_tb)
    timed_out = bool(_COLLECTIVE_TIMEOUT.search(root_message))
    if op is None and not (timed_out or _SECONDARY.search(root_message)):
        return "", states
    in_op = sorted(r for r, d in failed.items() if _collective_in(d["traceback"]) == op
                   and _where(d["traceback"]) == _where(root_tb))
    absent = [r for r in range(nproc) if r not in in_op]
    what = f"{op}" if op else "a collective"
    if timed_out:
        limit = f"{timeout_s} s" if timeout_s else "default 60 s"
        head = f"A collective timed out (MPU_LAB_TIMEOUT_S: {limit}): {what} at {_where(root_tb)}"
    elif _SECONDARY.search(root_message):
        head = f"A collective failed because a peer went away: {what} at {_where(root_tb)}"
    else:
        head = f"A collective failed: {what} at {_where(root_tb)}"
    lines = [f"{head}, reached by rank(s) {in_op}; every rank must call it, in the same order."]
    if absent:
        lines.append("Not in it: " + "; ".join(f"rank {r} {states[r]}" for r in absent) + ".")
    return "\n".join(lines), states


def _traceback_from_lines(lines, rank) -> str:
    mine = [t for r, t in lines if r == rank]
    for i, text in enumerate(mine):
        if text.startswith("Traceback (most recent call last)"):
            return "\n".join(mine[i:])
    return "\n".join(mine[-30:])


def _exit_codes(lines) -> Dict[int, int]:
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


def _first_failed_rank(lines) -> Optional[int]:
    """Parse torchrun's failure summary (``rank : 3 (local_rank: 3)``) as a fallback."""
    for _, text in lines:
        m = re.search(r"rank\s*:\s*(\d+)\s*\(local_rank", text)
        if m:
            return int(m.group(1))
    for r, text in lines:
        if r is not None and text.startswith("Traceback"):
            return r
    return None
