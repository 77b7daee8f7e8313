"""How long a learner really takes over a lab: measured in the learner's own kernel, kept on the
learner's own disk, shown by Start_Here beside the estimate.

A lab's resolve cell (``profiles.resolve``) starts a *sitting*: from then on IPython's
``post_run_cell`` event records each cell the learner runs. A sitting keeps

* ``active_s``: the time from the first cell to the last, less every pause longer than
  :data:`BREAK_S` (a pause that long is a break, not work);
* ``reached``: the furthest of the lab's core code cells run so far (a cell is recognised by its
  source, so a cell the learner edited is not counted as reached, and nothing is sent anywhere);
* ``done``: whether the last code cell of the core (before "Going further") has run.

A lab's measured time is the active time of a learner's sittings with it, in order, up to the
first one that reaches the end of the core (:func:`measured_minutes`). An instructor collects
the learners' files and prints the median per lab with
``python -m mpu_lab.labkit.notebooks sizes --times FILE [FILE ...]``.

The file is ``~/.mpu_lab/lab_times.json`` (``MPU_LAB_TIMES`` names another).

Only a person is timed. A notebook run by papermill, nbclient (``jupyter execute``,
``nbconvert --execute``) or nbval is no learner's sitting, whatever the environment says: the
kernel tells them apart by the request that runs the cell (:func:`run_by_executor`). Jupyter's
``execute_request`` carries ``allow_stdin``, whether the frontend can answer ``input()``: a
person's frontend (JupyterLab, Notebook, VS Code, a console) can; a batch executor sends
``False`` (nbclient sets its client's ``allow_stdin = False``, nbval executes with
``allow_stdin=False``), which is why ``input()`` fails under papermill. Outside a kernel (a
terminal IPython) the person is at the prompt. ``MPU_LAB_STOPWATCH=0`` turns recording off as
well (``regenerate`` and the test suite set it).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import statistics
import time
from typing import Callable, Dict, Iterable, List, Optional

TIMES_ENV = "MPU_LAB_TIMES"
OFF_ENV = "MPU_LAB_STOPWATCH"
BREAK_S = 20 * 60        # a pause longer than this between two cells is a break
# where a lab's core ends: its first "Going further" heading (Start_Here's table counts the same)
GOING_FURTHER = re.compile(r"^#+\s*Going further", re.M)
# cells the learner is meant to edit (a question's answer, an exercise's stub): never run as
# written, so they cannot mark how far the learner got
_EDITED = re.compile(r"\banswer = None\b|^def my_\w+\(", re.M)
_current: Optional["Sitting"] = None


def log_path() -> pathlib.Path:
    return pathlib.Path(os.environ.get(TIMES_ENV) or pathlib.Path.home() / ".mpu_lab" / "lab_times.json")


def enabled(ipython=None) -> bool:
    """Recording is on: not turned off (``MPU_LAB_STOPWATCH=0``) and the cell now running was
    sent by a person's frontend (:func:`run_by_executor`)."""
    return os.environ.get(OFF_ENV, "1") != "0" and not run_by_executor(ipython)


def _ipython():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def run_by_executor(ipython=None) -> bool:
    """Whether the cell now running in this kernel was sent by a batch executor (papermill,
    nbclient, nbval) rather than a person's frontend: its ``execute_request`` does not allow
    ``input()`` (``allow_stdin`` false; Jupyter's messaging protocol). False outside a kernel
    (no IPython, or a terminal IPython: a person at the prompt)."""
    ipython = _ipython() if ipython is None else ipython
    get_parent = getattr(getattr(ipython, "kernel", None), "get_parent", None)
    if get_parent is None:
        return False
    request = get_parent() or {}          # the message of the request being handled
    return not (request.get("content") or {}).get("allow_stdin", False)


def core_cells(notebook: pathlib.Path) -> List[str]:
    """The sources of the code cells before the first "Going further" heading, stripped: what
    a learner runs as written to work through the lab's core (the parameters cell, answer
    cells and exercise stubs left out)."""
    import nbformat

    core: List[str] = []
    for cell in nbformat.read(str(notebook), as_version=4).cells:
        if cell.cell_type == "markdown" and GOING_FURTHER.search(cell.source):
            break
        if (cell.cell_type == "code" and not _EDITED.search(cell.source)
                and "parameters" not in cell.metadata.get("tags", [])):
            core.append(cell.source.strip())
    return core


class Sitting:
    """One kernel's time with one lab, saved to :func:`log_path` after every cell."""

    def __init__(self, lab: str, core: List[str], path: pathlib.Path,
                 clock: Callable[[], float] = time.time):
        self.lab, self.path, self.clock = lab, path, clock
        self.index = {source: i for i, source in enumerate(core) if source}
        self.last_core = len(core) - 1
        self.started = self.last = clock()
        self.active_s, self.reached = 0.0, -1
        self.id = f"{self.started:.3f}-{os.getpid()}"

    def cell_ran(self, source: str) -> None:
        now = self.clock()
        pause = now - self.last
        if pause <= BREAK_S:
            self.active_s += pause
        self.last = now
        self.reached = max(self.reached, self.index.get(source.strip(), -1))
        self.save()

    @property
    def done(self) -> bool:
        return self.reached >= self.last_core >= 0

    def record(self) -> Dict[str, object]:
        return {"lab": self.lab, "started": round(self.started, 3), "active_s": round(self.active_s, 1),
                "reached": self.reached, "core_cells": self.last_core + 1, "done": self.done}

    def save(self) -> None:
        sittings = _read(self.path)
        sittings[self.id] = self.record()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"sittings": sittings}, indent=1) + "\n")
        os.replace(tmp, self.path)


def _read(path: pathlib.Path) -> Dict[str, Dict[str, object]]:
    try:
        return dict(json.loads(path.read_text())["sittings"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def start(notebook: str, lab_dir: pathlib.Path, ipython=None) -> Optional[Sitting]:
    """Start a sitting with ``lab_dir/notebook.ipynb`` in this IPython kernel (none outside
    IPython, with recording off, or in a notebook an executor runs: :func:`enabled`). Running
    the resolve cell again starts a new sitting."""
    global _current
    ipython = _ipython() if ipython is None else ipython
    path = lab_dir / f"{notebook}.ipynb"
    if ipython is None or not enabled(ipython) or not path.exists():
        return None
    if _current is not None:
        try:
            ipython.events.unregister("post_run_cell", _on_cell)
        except ValueError:
            pass
    _current = Sitting(notebook, core_cells(path), log_path())
    ipython.events.register("post_run_cell", _on_cell)
    return _current


def _on_cell(result) -> None:
    if _current is not None:
        _current.cell_ran(result.info.raw_cell or "")


def measured_minutes(paths: Iterable[pathlib.Path]) -> Dict[str, List[float]]:
    """``{lab: [minutes per learner]}``: for each file (one learner), each lab's active time
    over its sittings in order up to the first that reached the end of the core; a lab never
    worked through to the end of its core is left out."""
    per_lab: Dict[str, List[float]] = {}
    for path in paths:
        total: Dict[str, float] = {}
        finished = set()
        for sitting in sorted(_read(pathlib.Path(path)).values(), key=lambda s: s["started"]):
            lab = str(sitting["lab"])
            if lab in finished:
                continue
            total[lab] = total.get(lab, 0.0) + float(sitting["active_s"])
            if sitting["done"]:
                finished.add(lab)
                per_lab.setdefault(lab, []).append(total[lab] / 60)
    return per_lab


def median_minutes(paths: Iterable[pathlib.Path]) -> Dict[str, tuple]:
    """``{lab: (median minutes, learners)}`` over the files given."""
    return {lab: (statistics.median(m), len(m)) for lab, m in measured_minutes(paths).items()}
