"""Instructor tooling for the lab notebooks: re-execute, draw the figures, check the structure.

    python -m mpu_lab.notebooks regenerate                       # every notebook, default parameters
    python -m mpu_lab.notebooks regenerate --only 01 --only 04   # some of them
    python -m mpu_lab.notebooks regenerate --params labs/params_8gpu.yaml --output-dir /tmp/dgx
    python -m mpu_lab.notebooks figures                          # figures/*.png, byte for byte
    python -m mpu_lab.notebooks check                            # structure checks, no kernel

``regenerate`` runs each notebook through papermill in the notebook's own folder (what
``papermill --cwd labs`` does, and what nbval does), with the ``python3`` kernel. A notebook is
written back only when every cell ran without error; the saved copy carries outputs and
execution counts but no widget state and no papermill timing metadata, so ``git diff`` shows
only what changed. It prints the time each notebook took.

A parameters file is YAML::

    all:                 # offered to every notebook; each takes the names its `parameters` cell defines
      world_size: 8
      backend: nccl
    01_rank_groups:      # one notebook (file stem, or its number "01"); every name must exist there
      tp: 4

This module is also a pytest plugin (``-p mpu_lab.notebooks`` in ``pyproject.toml``): it tells
nbval not to compare ``stderr`` streams, which carry library warnings that change between
versions (PITFALLS.md).
"""
from __future__ import annotations

import argparse
import copy
import pathlib
import re
import sys
import tempfile
import time
from typing import Dict, Iterable, List, Optional, Sequence

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
MAX_LOGIC_LINES = 10    # "a notebook cell holds at most a few lines of logic" (STYLE.md)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_TRACEBACK = "Traceback (most recent call last)"


# --------------------------------------------------------------------------- which notebooks
def notebook_paths(root: pathlib.Path = REPO_ROOT) -> List[pathlib.Path]:
    """``Start_Here.ipynb`` then ``labs/*.ipynb`` in name order."""
    root = pathlib.Path(root)
    start = [root / "Start_Here.ipynb"] if (root / "Start_Here.ipynb").exists() else []
    return start + sorted((root / "labs").glob("*.ipynb"))


def _matches(path: pathlib.Path, selector) -> bool:
    """``selector`` names ``path``: its stem, its number (``"01"``, or YAML's int ``1``), or a
    leading part of the stem up to an underscore (``"start"`` for ``Start_Here``)."""
    stem, sel = path.stem.lower(), str(selector).lower()
    number = stem.split("_", 1)[0]
    if sel.isdigit() and number.isdigit():
        return int(sel) == int(number)
    return stem == sel or stem.startswith(sel + "_")


def select(paths: Sequence[pathlib.Path], only: Optional[Iterable[str]]) -> List[pathlib.Path]:
    """The notebooks named by ``only`` (stems or number prefixes such as ``"01"``), or all."""
    if not only:
        return list(paths)
    chosen = []
    for sel in only:
        hits = [p for p in paths if _matches(p, sel)]
        if not hits:
            raise SystemExit(f"--only {sel!r} matches no notebook; there are: "
                             f"{', '.join(p.stem for p in paths)}")
        chosen += [p for p in hits if p not in chosen]
    return [p for p in paths if p in chosen]


# --------------------------------------------------------------------------- parameters
def load_params(path) -> Dict[str, dict]:
    """Read a parameters YAML file: ``{"all": {...}, "<notebook>": {...}}``."""
    import yaml

    data = yaml.safe_load(pathlib.Path(path).read_text()) or {}
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise SystemExit(f"{path}: expected sections of name: value pairs, e.g. 'all: "
                         f"{{world_size: 8}}' (see python -m mpu_lab.notebooks --help)")
    return data


def declared_parameters(nb) -> List[str]:
    """Names assigned in the cell tagged ``parameters`` (what papermill may override)."""
    import papermill

    return list(papermill.inspect_notebook(nb).keys()) if _parameter_cells(nb) else []


def _parameter_cells(nb) -> List[int]:
    return [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]


def params_for(path: pathlib.Path, nb, params: Dict[str, dict]) -> Dict[str, object]:
    """The values this notebook gets from a parameters file (``all`` first, then its own)."""
    declared = set(declared_parameters(nb))
    chosen = {k: v for k, v in (params.get("all") or {}).items() if k in declared}
    for section, values in params.items():
        if section != "all" and _matches(path, section):
            unknown = sorted(set(values) - declared)
            if unknown:
                raise SystemExit(f"parameters for {path.name}: {unknown} not in its parameters "
                                 f"cell, which defines {sorted(declared)}")
            chosen.update(values)
    return chosen


def check_param_sections(paths: Sequence[pathlib.Path], params: Dict[str, dict]) -> None:
    """Every section names a notebook, and every name under ``all`` is used by one."""
    import nbformat

    all_declared = set()
    for path in paths:
        all_declared |= set(declared_parameters(nbformat.read(path, as_version=4)))
    for section in params:
        if section != "all" and not any(_matches(p, section) for p in paths):
            raise SystemExit(f"parameters section {section!r} names no notebook")
    unused = sorted(set(params.get("all") or {}) - all_declared)
    if unused:
        raise SystemExit(f"parameters {unused} under 'all' are defined by no notebook "
                         f"(known: {sorted(all_declared)})")


# --------------------------------------------------------------------------- cleaning
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


# --------------------------------------------------------------------------- structure checks
def _output_problems(nb) -> List[str]:
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                problems.append(f"cell {i} stores an error output ({out.get('ename')})")
            text = out.get("text", "") or out.get("data", {}).get("text/plain", "")
            if isinstance(text, list):
                text = "".join(text)
            if _TRACEBACK in text:
                problems.append(f"cell {i} prints a traceback")
    return problems


def _logic_lines(source: str) -> int:
    return sum(1 for line in source.splitlines()
               if line.strip() and not line.strip().startswith(("#", "%")))


def heading_anchors(nb) -> List[str]:
    """The anchors JupyterLab and nbconvert give a notebook's headings (spaces become ``-``)."""
    anchors = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
                if m:
                    anchors.append(m.group(1).replace(" ", "-"))
    return anchors


def _links_ok(path: pathlib.Path, text: str) -> List[str]:
    """Relative links (and their ``#anchors`` into notebooks) that lead nowhere."""
    import nbformat

    bad = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # web links and in-page anchors
        file_part, _, anchor = target.partition("#")
        linked = path.parent / file_part
        if file_part and not linked.exists():
            bad.append(target)
        elif anchor and linked.suffix == ".ipynb":
            if anchor not in heading_anchors(nbformat.read(linked, as_version=4)):
                bad.append(target)
    return bad


def structure_problems(root=REPO_ROOT) -> List[str]:
    """What would break nbval, papermill or a learner, notebook by notebook (no kernel)."""
    import nbformat

    problems = []
    for path in notebook_paths(root):
        name = path.relative_to(root)
        try:
            nb = nbformat.read(path, as_version=4)
            nbformat.validate(nb)
        except Exception as exc:
            problems.append(f"{name}: not a valid notebook ({exc})")
            continue
        if "widgets" in nb.metadata:
            problems.append(f"{name}: saved widget state in metadata.widgets")
        if "papermill" in nb.metadata:
            problems.append(f"{name}: papermill metadata left in (run it through clean())")
        if nb.metadata.get("kernelspec", {}).get("name") != "python3":
            problems.append(f"{name}: kernelspec is not python3")
        problems += [f"{name}: {p}" for p in _output_problems(nb)]
        is_lab = path.parent.name == "labs"
        params = _parameter_cells(nb)
        if is_lab and len(params) != 1:
            problems.append(f"{name}: {len(params)} cells tagged 'parameters' (need exactly one)")
        code_seen = False
        for i, cell in enumerate(nb.cells):
            tags = cell.get("metadata", {}).get("tags", [])
            if cell.cell_type == "markdown":
                problems += [f"{name}: cell {i} links to missing {t}"
                             for t in _links_ok(path, cell.source)]
                continue
            if cell.cell_type != "code":
                continue
            code_seen = True
            if cell.get("outputs") and cell.get("execution_count") is None:
                problems.append(f"{name}: cell {i} has outputs but no execution_count")
            if cell.get("execution_count") is None and "parameters" not in tags and cell.source.strip():
                problems.append(f"{name}: cell {i} was not executed")
            if "parameters" not in tags and _logic_lines(cell.source) > MAX_LOGIC_LINES:
                problems.append(f"{name}: cell {i} has {_logic_lines(cell.source)} lines of logic "
                                f"(at most {MAX_LOGIC_LINES}; move it into mpu_lab)")
            if "interact" in cell.source and "nbval-ignore-output" not in tags:
                problems.append(f"{name}: cell {i} is interactive but not tagged nbval-ignore-output")
            if "elapsed_s" in cell.source and "nbval-ignore-output" not in tags:
                problems.append(f"{name}: cell {i} prints a timing but is compared by nbval")
        if is_lab:
            first = nb.cells[0] if nb.cells else None
            if (first is None or first.cell_type != "markdown"
                    or "learning objectives" not in first.source.lower()):
                problems.append(f"{name}: the first cell must state the learning objectives")
            last = nb.cells[-1] if nb.cells else None
            footer = last.source if last is not None and last.cell_type == "markdown" else ""
            for word in ("Previous", "Home", "Next"):
                if word not in footer:
                    problems.append(f"{name}: footer (last cell) lacks a {word!r} link")
            sources = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
            if "launch.run(" not in sources:
                problems.append(f"{name}: no torchrun job (mpu_lab.launch.run)")
            if not re.search(r"\bcheck_\w+\(", sources):
                problems.append(f"{name}: no exercise check (check_...)")
            if not code_seen:
                problems.append(f"{name}: no code cells")
    return problems


# --------------------------------------------------------------------------- environment
def environment(nranks: int = 8) -> Dict[str, object]:
    """Print (and return) what the labs will run on: Start_Here's environment check."""
    import os
    import platform

    import torch

    from mpu_lab import distributed, launch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    forced = os.environ.get("MPU_LAB_BACKEND", "auto")
    backend = distributed.choose_backend(nranks, gpus) if forced == "auto" else forced
    info = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cpu_cores": os.cpu_count(), "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "backend_for_ranks": backend, "ranks": nranks, "max_ranks": launch.max_ranks(),
    }
    for module in ("ipywidgets", "matplotlib", "papermill", "nbval"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            info[module] = "not installed"
    print(f"Python {info['python']}, torch {info['torch']}, {info['cpu_cores']} CPU cores")
    print(f"GPUs seen: {gpus}" + (f" ({', '.join(info['gpus'])})" if gpus else
                                  " -> ranks are CPU processes"))
    how = ("one GPU per rank" if backend == "nccl" else
           "ranks share the GPU(s)" if gpus else "CPU tensors")
    print(f"a job of {nranks} ranks uses backend {backend} ({how}); this machine starts at most "
          f"{info['max_ranks']} ranks per job")
    print("lab tools: " + ", ".join(f"{m} {info[m]}" for m in ("ipywidgets", "matplotlib",
                                                               "papermill", "nbval")))
    return info


# --------------------------------------------------------------------------- pytest plugin
def pytest_configure(config):
    """Resolve a relative ``--nbval-sanitize-with`` against the rootdir, so pytest finds the
    sanitize file from any working directory (nbval opens it relative to the cwd)."""
    name = getattr(config.option, "nbval_sanitize_with", None)
    if name and not pathlib.Path(name).is_absolute() and not pathlib.Path(name).exists():
        candidate = pathlib.Path(str(config.rootpath)) / name
        if candidate.exists():
            config.option.nbval_sanitize_with = str(candidate)


def pytest_collection_modifyitems(session, config, items):
    """nbval compares stderr streams; library warnings there differ between versions."""
    for item in items:
        parent = getattr(item, "parent", None)
        skip = getattr(parent, "skip_compare", None)
        if skip is not None and "stderr" not in skip:
            parent.skip_compare = tuple(skip) + ("stderr",)


# --------------------------------------------------------------------------- command line
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mpu_lab.notebooks",
        description="Re-execute the lab notebooks, regenerate figures/, check notebook structure.",
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    reg = sub.add_parser("regenerate", help="re-execute notebooks with papermill and save them")
    reg.add_argument("--params", help="YAML file of parameters (see above)")
    reg.add_argument("--only", action="append", help="notebook stem or number, e.g. 01 (repeatable)")
    reg.add_argument("--output-dir", help="write executed notebooks under this folder instead "
                                          "of in place (same relative paths)")
    reg.add_argument("--kernel", default="python3", help="Jupyter kernel (default %(default)s)")
    reg.add_argument("--cell-timeout", type=int, default=900,
                     help="seconds one cell may run (default %(default)s)")
    fig = sub.add_parser("figures", help="regenerate figures/*.png deterministically")
    fig.add_argument("--out", default=str(REPO_ROOT / "figures"))
    sub.add_parser("check", help="structure checks (no kernel)")
    args = parser.parse_args(argv)

    if args.command == "regenerate":
        paths = select(notebook_paths(), args.only)
        params = load_params(args.params) if args.params else {}
        regenerate(paths, params, output_dir=args.output_dir, kernel=args.kernel,
                   timeout_s=args.cell_timeout)
        return 0
    if args.command == "figures":
        from mpu_lab import viz

        for path in viz.save_figures(args.out):
            print(path)
        return 0
    problems = structure_problems()
    for p in problems:
        print(p)
    print(f"{len(notebook_paths())} notebooks checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
