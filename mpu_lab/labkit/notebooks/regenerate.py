"""Re-execute notebooks with papermill (watched for a kernel that stops answering) and write
back only those that ran cleanly, cleaned of widget state and timing metadata, so ``git diff``
shows only what changed."""
from __future__ import annotations

import copy
import dataclasses
import os
import pathlib
import re
import sys
import time
from typing import Dict, List, Optional, Sequence

from mpu_lab.labkit import REPO_ROOT
from mpu_lab.labkit.notebooks import stopwatch
from mpu_lab.labkit.notebooks.selection import check_param_sections, params_for
from mpu_lab.labkit.notebooks.sizing import record_compute_times
from mpu_lab.labkit.notebooks.structure import REVEAL, output_problems
from mpu_lab.labkit.notebooks.watchdog import DEFAULT_STALL_S, execute_watched

KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
NBVAL_IGNORE = "nbval-ignore-output"
# A cell that calls a lab kit's reveal(...) (not one that defines it) shows a prediction's answer.
_REVEAL_CALL = re.compile(r"^(?![ \t]*def[ \t])[^#\n]*\breveal\(", re.M)


def mark_reveal(cell) -> bool:
    """Tag a code cell that calls ``reveal(...)`` ``reveal`` and ``nbval-ignore-output`` (what
    :func:`~mpu_lab.labkit.notebooks.structure.lesson_problems` asks of a reveal cell), so that
    a lab author who forgets the tags still gets it stored empty; True when it is a reveal cell."""
    if cell.cell_type != "code":
        return False
    tags = cell.metadata.get("tags", [])
    if REVEAL not in tags and not _REVEAL_CALL.search(cell.source):
        return False
    cell.metadata["tags"] = tags + [t for t in (REVEAL, NBVAL_IGNORE) if t not in tags]
    return True


def clean(nb):
    """Drop widget state, papermill/nbclient timing metadata and the outputs of cells tagged
    ``reveal`` or calling ``reveal(...)`` (a prediction's answer; :func:`mark_reveal` tags
    them); set the python3 kernelspec."""
    nb.metadata.pop("widgets", None)
    nb.metadata.pop("papermill", None)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    for cell in nb.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
        if mark_reveal(cell):
            cell.outputs = []      # the answer to a prediction: the learner runs it to see it
        if cell.cell_type == "code":
            for out in cell.get("outputs", []):
                # widget views keep a model id that means nothing once the kernel is gone
                data = out.get("data", {})
                data.pop("application/vnd.jupyter.widget-view+json", None)
    return nb


def _without_injected(nb):
    nb = copy.deepcopy(nb)
    nb.cells = [c for c in nb.cells
                if "injected-parameters" not in c.get("metadata", {}).get("tags", [])]
    return nb


# --------------------------------------------------------------------------- regenerate
def execute(path: pathlib.Path, parameters: Dict[str, object], kernel: str = "python3",
            timeout_s: Optional[int] = None, stall_s: float = DEFAULT_STALL_S, out=sys.stdout,
            **watch):
    """Run one notebook with papermill in its own folder; return the executed, cleaned node.

    Papermill runs in a watched child process (:mod:`~mpu_lab.labkit.notebooks.watchdog`): a
    kernel that stops answering for ``stall_s`` seconds (no output, no CPU time) is killed
    with everything it started, and the notebook is run once more.
    """
    import nbformat

    nb = _without_injected(nbformat.read(path, as_version=4))
    executed = execute_watched(nb, path.parent, parameters, kernel=kernel, timeout_s=timeout_s,
                               stall_s=stall_s, out=out, name=path.name, **watch)
    return clean(executed)


@dataclasses.dataclass
class Outcome:
    """What became of one notebook."""
    name: str
    ok: bool
    seconds: float
    message: str = ""                 # why it failed (the error's last line)
    target: Optional[pathlib.Path] = None


def run_notebooks(paths: Sequence[pathlib.Path], params: Optional[Dict[str, dict]] = None,
                  output_dir=None, kernel: str = "python3", timeout_s: Optional[int] = None,
                  stall_s: float = DEFAULT_STALL_S, out=sys.stdout,
                  known: Optional[Sequence[pathlib.Path]] = None, **watch) -> List[Outcome]:
    """Re-execute ``paths``; write each back (or into ``output_dir``) only if it succeeded.
    Prints one line per notebook; returns an :class:`Outcome` per notebook. ``known``: the
    notebooks the parameters' sections may name (default ``paths``; all of them when ``paths``
    is a selection, so that ``--only 01`` works with a file that has a section for 02)."""
    import nbformat

    params = params or {}
    if params:
        check_param_sections(known or paths, params)
    os.environ[stopwatch.OFF_ENV] = "0"   # the kernels it starts are no learner's sitting
    outcomes = []
    for path in paths:
        values = params_for(path, nbformat.read(path, as_version=4), params)
        start = time.monotonic()
        try:
            nb = execute(path, values, kernel=kernel, timeout_s=timeout_s, stall_s=stall_s,
                         out=out, **watch)
            problems = [p for p in output_problems(nb)]
            if problems:
                raise RuntimeError("; ".join(problems))
        except Exception as exc:  # papermill's errors, a stall that came back
            seconds = time.monotonic() - start
            first = str(exc).strip().splitlines()
            message = first[-1] if first else type(exc).__name__
            outcomes.append(Outcome(path.name, False, seconds, message))
            print(f"{path.name:32s} {seconds:6.1f} s  FAILED, not written: {message}",
                  file=out, flush=True)
            continue
        seconds = time.monotonic() - start
        target = path
        if output_dir:
            inside = path.resolve().is_relative_to(REPO_ROOT)
            target = pathlib.Path(output_dir) / (path.resolve().relative_to(REPO_ROOT) if inside
                                                 else path.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(target))
        outcomes.append(Outcome(path.name, True, seconds, target=target))
        shown = f" with {values}" if values else ""
        print(f"{path.name:32s} {seconds:6.1f} s  written{shown}", file=out, flush=True)
    written = [o for o in outcomes if o.ok]
    print(f"{'total':32s} {sum(o.seconds for o in written):6.1f} s  ({len(written)} written, "
          f"{len(outcomes) - len(written)} failed)", file=out, flush=True)
    return outcomes


def regenerate(paths: Sequence[pathlib.Path], params: Optional[Dict[str, dict]] = None,
               output_dir=None, kernel: str = "python3", timeout_s: Optional[int] = None,
               out=sys.stdout, stall_s: float = DEFAULT_STALL_S,
               known: Optional[Sequence[pathlib.Path]] = None, **watch) -> Dict[str, float]:
    """Re-execute ``paths``; write each back (or into ``output_dir``) only if it succeeded.

    Returns ``{notebook name: seconds}``; raises ``SystemExit`` naming the failures at the end
    (the notebooks that failed are left untouched). ``stall_s``: see :func:`execute`;
    ``known``: see :func:`run_notebooks`.
    """
    outcomes = run_notebooks(paths, params, output_dir=output_dir, kernel=kernel,
                             timeout_s=timeout_s, stall_s=stall_s, out=out, known=known,
                             **watch)
    labs = {p.name for p in paths if p.resolve().parent == (REPO_ROOT / "labs").resolve()}
    if output_dir is None and not params and labs:
        # the committed labs at their own defaults: Start_Here's table reads these seconds
        record_compute_times({o.name: o.seconds for o in outcomes if o.ok and o.name in labs})
    failed = [o.name for o in outcomes if not o.ok]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")
    return {o.name: o.seconds for o in outcomes}
