"""Instructor tooling for the lab notebooks: re-execute, draw the figures, check the structure.

* :mod:`~mpu_lab.labkit.notebooks.selection` — which notebooks, and the values an
  instructor's parameters file gives each;
* :mod:`~mpu_lab.labkit.notebooks.regenerate` — re-execute with papermill, write back cleaned;
* :mod:`~mpu_lab.labkit.notebooks.structure` — structure checks, no kernel;
* :mod:`~mpu_lab.labkit.notebooks.environment` — Start_Here's environment check;
* :mod:`~mpu_lab.labkit.notebooks.plugin` — the nbval fixes, re-exported here so this package
  is the pytest plugin (``-p mpu_lab.labkit.notebooks`` in ``pyproject.toml``);
* :mod:`~mpu_lab.labkit.notebooks.cli` — ``python -m mpu_lab.labkit.notebooks regenerate |
  figures | check`` (``--help`` for the parameters file's format).

Importing this package loads neither torch nor matplotlib (pytest loads it as a plugin for
every run); the command line does.
"""
from mpu_lab.labkit import REPO_ROOT
from mpu_lab.labkit.notebooks.environment import environment
from mpu_lab.labkit.notebooks.plugin import pytest_collection_modifyitems, pytest_configure
from mpu_lab.labkit.notebooks.regenerate import KERNELSPEC, clean, execute, regenerate
from mpu_lab.labkit.notebooks.selection import (
    check_param_sections,
    declared_parameters,
    load_params,
    notebook_paths,
    params_for,
    select,
)
from mpu_lab.labkit.notebooks.structure import (
    MAX_LOGIC_LINES,
    REVEAL,
    heading_anchors,
    lesson_problems,
    structure_problems,
)

__all__ = [
    "REPO_ROOT", "KERNELSPEC", "MAX_LOGIC_LINES", "notebook_paths", "select", "load_params",
    "declared_parameters", "params_for", "check_param_sections", "clean", "execute",
    "regenerate", "heading_anchors", "structure_problems", "lesson_problems", "REVEAL", "environment",
    "pytest_configure", "pytest_collection_modifyitems",
]
