"""Re-execute notebooks with papermill and write back only those that ran cleanly, cleaned of
widget state and timing metadata, so ``git diff`` shows only what changed."""
from __future__ import annotations

import copy
import pathlib
import sys
import tempfile
import time
from typing import Dict, Optional, Sequence

from mpu_lab.labkit import REPO_ROOT
from mpu_lab.labkit.notebooks.selection import check_param_sections, params_for
from mpu_lab.labkit.notebooks.structure import _output_problems

KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def clean(nb):
    """Drop widget state, papermill/nbclient timing metadata; set the python3 kernelspec."""
    nb.metadata.pop("widgets", None)
    nb.metadata.pop("papermill", None)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    for cell in nb.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
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
            timeout_s: Optional[int] = None):
    """Run one notebook with papermill in its own folder; return the executed, cleaned node."""
    import nbformat
    import papermill

    nb = _without_injected(nbformat.read(path, as_version=4))
    with tempfile.TemporaryDirectory(prefix="mpu_lab_nb_") as tmp:
        out = pathlib.Path(tmp) / path.name
        executed = papermill.execute_notebook(
            nb, str(out), parameters=parameters or None, kernel_name=kernel,
            cwd=str(path.parent), progress_bar=False, log_output=False,
            request_save_on_cell_execute=False, execution_timeout=timeout_s)
    return clean(executed)


def regenerate(paths: Sequence[pathlib.Path], params: Optional[Dict[str, dict]] = None,
               output_dir=None, kernel: str = "python3", timeout_s: Optional[int] = None,
               out=sys.stdout) -> Dict[str, float]:
    """Re-execute ``paths``; write each back (or into ``output_dir``) only if it succeeded.

    Returns ``{notebook name: seconds}``; raises ``SystemExit`` naming the failures at the end
    (the notebooks that failed are left untouched).
    """
    import nbformat

    params = params or {}
    if params:
        check_param_sections(paths, params)
    times, failed = {}, []
    for path in paths:
        values = params_for(path, nbformat.read(path, as_version=4), params)
        start = time.monotonic()
        try:
            nb = execute(path, values, kernel=kernel, timeout_s=timeout_s)
            problems = [p for p in _output_problems(nb)]
            if problems:
                raise RuntimeError("; ".join(problems))
        except Exception as exc:  # papermill's PapermillExecutionError included
            seconds = time.monotonic() - start
            first = str(exc).strip().splitlines()
            failed.append(path.name)
            print(f"{path.name:32s} {seconds:6.1f} s  FAILED, not written: "
                  f"{first[-1] if first else type(exc).__name__}", file=out, flush=True)
            continue
        seconds = time.monotonic() - start
        target = path
        if output_dir:
            inside = path.resolve().is_relative_to(REPO_ROOT)
            target = pathlib.Path(output_dir) / (path.resolve().relative_to(REPO_ROOT) if inside
                                                 else path.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(target))
        times[path.name] = seconds
        shown = f" with {values}" if values else ""
        print(f"{path.name:32s} {seconds:6.1f} s  written{shown}", file=out, flush=True)
    print(f"{'total':32s} {sum(times.values()):6.1f} s  ({len(times)} written, "
          f"{len(failed)} failed)", file=out, flush=True)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")
    return times

