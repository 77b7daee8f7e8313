"""The pytest plugin (``-p mpu_lab.labkit.notebooks`` in ``pyproject.toml``) that fits nbval to
these notebooks: the sanitize file is found from any working directory, and ``stderr``
streams are left out of the comparison (library warnings, such as a deprecation notice a newer
torch prints, change between versions while the notebook's results do not)."""
from __future__ import annotations

import os
import pathlib

from mpu_lab.labkit.notebooks.stopwatch import OFF_ENV


def pytest_configure(config):
    """Resolve a relative ``--nbval-sanitize-with`` against the rootdir, so pytest finds the
    sanitize file from any working directory (nbval opens it relative to the cwd). Turn the
    learner's stopwatch off: a notebook nbval runs is no learner's sitting."""
    os.environ[OFF_ENV] = "0"
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

