"""The learner's own Megatron: a folder of modules (``my_megatron/`` beside the notebooks) into
which each whole-piece exercise saves the learner's code once the grader says it is right.

One module per piece, under the names the capstone reads (:mod:`mpu_lab.labkit.capstone`:
``mappings.py``, ``layers.py``, ``cross_entropy.py``, ``random.py``, ``schedules.py``,
``distributed_data_parallel.py``, ``distrib_optimizer.py``, ...). A module may hold several
pieces written in different labs (``layers.py``: the column-parallel linear in one lab, the
row-parallel one in the next): saving a piece replaces its earlier definition, or adds it, and
leaves the rest of the file alone.

The source is the learner's own, as they typed it in their notebook cell (IPython keeps every
cell's text in :mod:`linecache`); a class defined in a notebook is found from its methods' code.
The folder is ``my_megatron`` in the working directory, or ``$MPU_LAB_MY_MEGATRON``.
"""
from __future__ import annotations

import ast
import inspect
import linecache
import os
import pathlib
import textwrap
from typing import Callable, List, Optional, Sequence

ENV = "MPU_LAB_MY_MEGATRON"

REGIONS = ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
           "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
           "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
           "scatter_to_sequence_parallel_region")

_COMMON = '''"""My own Megatron: pieces I wrote in the mpu_lab course, each saved by its lab's grader
once it was right. `python -m mpu_lab.labkit.capstone --code my_megatron ...` trains a GPT
with them (lab 18). The imports are the names every rank had when the grader ran them."""
import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import mpu_lab
from mpu_lab.core import parallel_state, tensor_parallel
from mpu_lab.core.tensor_parallel import mappings as _mirror_mappings
from mpu_lab.core.utils import get_device
'''

# mappings.py: the mirror's f, g, ... until the learner's own definitions below replace them.
MAPPINGS_HEADER = _COMMON + '''
for _name in %r:
    globals()[_name] = getattr(_mirror_mappings, _name)
''' % (REGIONS,)

# every other module: f, g, ... from my own mappings.py where it defines them (so my layers run
# on my mappings, as a package's modules import each other), else the mirror's.
HEADER = _COMMON + '''
try:
    from . import mappings as _my_mappings
except ImportError:                  # no mappings.py of mine yet, or not imported as a package
    _my_mappings = None
for _name in %r:
    globals()[_name] = getattr(_my_mappings, _name, None) or getattr(_mirror_mappings, _name)
''' % (REGIONS,)


def folder(path: Optional[os.PathLike] = None) -> pathlib.Path:
    """The learner's package folder: ``path``, else ``$MPU_LAB_MY_MEGATRON``, else
    ``./my_megatron``."""
    return pathlib.Path(path or os.environ.get(ENV) or "my_megatron")


def _class_source(cls: type) -> str:
    """A class's source when :func:`inspect.getsource` cannot find it (a class typed in a
    notebook cell: its module ``__main__`` has no file): the cell that holds its methods."""
    for member in vars(cls).values():
        fn = getattr(member, "__func__", member)
        code = getattr(fn, "__code__", None)
        if code is None:
            continue
        lines = linecache.getlines(code.co_filename)
        for start in range(min(code.co_firstlineno, len(lines)) - 1, -1, -1):
            if lines[start].lstrip().startswith(f"class {cls.__name__}"):
                return "".join(inspect.getblock(lines[start:]))
    raise OSError(f"cannot find the source of class {cls.__name__}: define it in a cell of its own")


def source_of(obj: Callable) -> str:
    """The learner's source of a function or class, dedented."""
    try:
        text = inspect.getsource(obj)
    except (OSError, TypeError):
        if not isinstance(obj, type):
            raise
        text = _class_source(obj)
    return textwrap.dedent(text)


# Values the playground gives each rank that a module cannot hold (they are known only once the
# rank has started): a saved piece that reads them works in the grader and not in the capstone.
RANK_VALUES = {"device": "get_device()", "rank": "dist.get_rank()",
               "world_size": "dist.get_world_size()"}


def _global_names(obj) -> set:
    """The global names the code of a function, or of a class's methods, reads."""
    codes = [getattr(getattr(m, "__func__", m), "__code__", None)
             for m in (vars(obj).values() if isinstance(obj, type) else [obj])]
    names, todo = set(), [c for c in codes if c is not None]
    while todo:
        code = todo.pop()
        names.update(code.co_names)
        todo += [c for c in code.co_consts if hasattr(c, "co_names")]
    return names


def rank_values_read(pieces: Sequence[Callable]) -> List[str]:
    """The per-rank values (``device``, ``rank``, ``world_size``) ``pieces`` read as globals,
    each with what a module should call instead."""
    used = set().union(*(_global_names(p) for p in pieces)) if pieces else set()
    return [f"{name} (use {RANK_VALUES[name]})" for name in sorted(RANK_VALUES) if name in used]


def _renamed(text: str, old: str, new: str) -> str:
    """``text`` with its definition line's name ``old`` replaced by ``new``."""
    if old == new:
        return text
    for keyword in ("def ", "class "):
        marker = f"{keyword}{old}"
        at = text.find(marker)
        if at >= 0:
            return text[:at] + f"{keyword}{new}" + text[at + len(marker):]
    return text


def _without(text: str, name: str) -> str:
    """``text`` (a module) with its top-level definition of ``name`` removed."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            del lines[start:node.end_lineno]
            break
    return "".join(lines)


def save_piece(pieces: Sequence[Callable], module: str, names: Sequence[str] = (),
               where: Optional[os.PathLike] = None) -> pathlib.Path:
    """Write ``pieces`` (functions or classes) into ``<folder>/<module>``, each under its name
    in ``names`` (default: its own), replacing an earlier definition of the same name."""
    names = list(names) or [p.__name__ for p in pieces]
    if len(names) != len(pieces):
        raise ValueError(f"{len(pieces)} piece(s) but {len(names)} name(s): {names}")
    path = folder(where) / module
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "__init__.py").touch()
    text = (path.read_text() if path.exists()
            else MAPPINGS_HEADER if module == "mappings.py" else HEADER)
    for piece, name in zip(pieces, names):
        text = _without(text, name).rstrip("\n") + "\n\n\n"
        text += _renamed(source_of(piece), piece.__name__, name).rstrip("\n") + "\n"
    ast.parse(text)                      # what is saved must import
    path.write_text(text)
    return path


def saved_names(module: str, where: Optional[os.PathLike] = None) -> List[str]:
    """The top-level functions and classes ``<folder>/<module>`` defines (empty when absent)."""
    path = folder(where) / module
    if not path.exists():
        return []
    return [n.name for n in ast.parse(path.read_text()).body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
