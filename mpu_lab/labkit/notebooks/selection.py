"""Which notebooks: ``Start_Here.ipynb`` and ``labs/*.ipynb``, picked by stem or number, and the
values each one gets from an instructor's parameters file (YAML, see
``python -m mpu_lab.labkit.notebooks --help``)."""
from __future__ import annotations

import pathlib
from typing import Dict, Iterable, List, Optional, Sequence

from mpu_lab.labkit import REPO_ROOT


def notebook_paths(root: pathlib.Path = REPO_ROOT) -> List[pathlib.Path]:
    """``Start_Here.ipynb`` then ``labs/*.ipynb`` in name order."""
    root = pathlib.Path(root)
    start = [root / "Start_Here.ipynb"] if (root / "Start_Here.ipynb").exists() else []
    return start + lab_paths(root)


def lab_paths(root: pathlib.Path = REPO_ROOT) -> List[pathlib.Path]:
    """``labs/*.ipynb`` in name order (the labs, without Start_Here)."""
    return sorted((pathlib.Path(root) / "labs").glob("*.ipynb"))


def _matches(path: pathlib.Path, selector) -> bool:
    """``selector`` names ``path``: its stem, its number (``"01"``, or YAML's int ``1``), or a
    leading part of the stem up to an underscore (``"start"`` for ``Start_Here``)."""
    stem, sel = path.stem.lower(), str(selector).lower()
    number = stem.split("_", 1)[0]
    if sel.isdigit() and number.isdigit():
        return int(sel) == int(number)
    return stem == sel or stem.startswith(sel + "_")


matches = _matches   # public name (mpu_lab.labkit.profiles reads profile sections with it)


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
    """Read a parameters YAML file: ``{"all": {...}, "<notebook>": {...}}``.

    A file may start from another: ``include: profiles/8gpu.yaml`` (relative to the file)
    reads that one first; its own sections then override it name by name
    (``labs/params_8gpu.yaml`` is such a pointer to the 8gpu machine profile).
    """
    import yaml

    path = pathlib.Path(path)
    data = yaml.safe_load(path.read_text()) or {}
    include = data.pop("include", None) if isinstance(data, dict) else None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise SystemExit(f"{path}: expected sections of name: value pairs, e.g. 'all: "
                         f"{{world_size: 8}}' (see python -m mpu_lab.labkit.notebooks --help)")
    if include is None:
        return data
    merged = {k: dict(v) for k, v in load_params(path.parent / str(include)).items()}
    for section, values in data.items():
        merged.setdefault(section, {}).update(values)
    return merged


def declared_parameters(nb) -> List[str]:
    """Names assigned in the cell tagged ``parameters`` (what papermill may override)."""
    import papermill

    return list(papermill.inspect_notebook(nb).keys()) if parameter_cells(nb) else []


def parameter_cells(nb) -> List[int]:
    """Indices of the cells tagged ``parameters`` (papermill's)."""
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

