"""A folder of the learner's modules as the capstone reads it (``--code DIR``): which file
defines which top-level function or class, read from the source without importing it. The
capstone's job (``launch/capstone.py``) imports each piece from the file this names; the lab
kit's survey (``mpu_lab.labkit.capstone.lesson``) shows the same table before the run."""
from __future__ import annotations

import ast
import pathlib
from typing import Dict, List


def defining_files(folder) -> Dict[str, List[str]]:
    """``{name: [file, ...]}``: the modules of ``folder`` (names Python can import; the
    ``NN_topic.py`` scripts are not) that define ``name`` at their top level. A file Python
    cannot parse defines nothing (the capstone's pre-check refuses it by name)."""
    found: Dict[str, List[str]] = {}
    for path in sorted(pathlib.Path(folder).glob("*.py")):
        if not path.stem.isidentifier():
            continue
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                found.setdefault(node.name, []).append(path.name)
    return found
