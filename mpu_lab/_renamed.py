"""Old module paths that still import, each mapped to where its code lives now.

The lab kit and the launcher used to sit flat in ``mpu_lab/`` (``mpu_lab.viz``,
``mpu_lab.launch``, …); see ``docs/ARCHITECTURE.md``. So that notebooks and scripts written
against those paths keep working, ``import mpu_lab.viz`` is answered with the module that
replaced it, without a file at the old place. A path whose module was split in several maps
to a module that holds the public names of all the parts.

Nothing inside the repository imports an old path (``tests/test_architecture.py`` checks);
this table is only for code outside it. Standard library only.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from typing import Dict, Tuple, Union

# old path -> new module, or the new modules whose names it gathers
RENAMED: Dict[str, Union[str, Tuple[str, ...]]] = {
    "mpu_lab.launch": "mpu_lab.launcher",
    "mpu_lab.viz": "mpu_lab.labkit.viz",
    "mpu_lab.exercises": "mpu_lab.labkit.exercises",
    "mpu_lab.playground": "mpu_lab.labkit.playground",
    "mpu_lab.notebooks": "mpu_lab.labkit.notebooks",
    "mpu_lab.train_runs": "mpu_lab.labkit.gpt_runs",
    "mpu_lab.models.inspect": "mpu_lab.models.introspection",
    "mpu_lab.models.memory": "mpu_lab.perf.activation_memory",
    "mpu_lab.perf.model": "mpu_lab.perf.cost_model",
    "mpu_lab.perf.measure": ("mpu_lab.perf.bandwidth", "mpu_lab.perf.breakdown",
                             "mpu_lab.perf.utilisation", "mpu_lab.perf.runs", "mpu_lab.timers"),
}


def _gathered(name: str, parts: Tuple[str, ...]) -> types.ModuleType:
    module = types.ModuleType(name, f"Names of {', '.join(parts)} (old path {name}).")
    for part in parts:
        source = importlib.import_module(part)
        module.__dict__.update({k: v for k, v in vars(source).items()
                                if not (k.startswith("__") and k.endswith("__"))})
    return module


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target):
        self.target = target

    def create_module(self, spec):
        if isinstance(self.target, str):
            return importlib.import_module(self.target)
        return _gathered(spec.name, self.target)

    def exec_module(self, module):   # the module is already complete
        pass

    def get_code(self, fullname):
        """``python -m OLD_PATH`` runs the new module (or package's ``__main__``) instead."""
        if not isinstance(self.target, str):
            raise ImportError(f"{fullname} was split; run one of {self.target} instead")
        return compile(f"import runpy\nrunpy.run_module({self.target!r}, run_name='__main__', "
                       f"alter_sys=True)\n", f"<{fullname}: now {self.target}>", "exec")


class _RenamedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in RENAMED:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(RENAMED[fullname]))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``mpu_lab/__init__.py`` calls it)."""
    if not any(isinstance(f, _RenamedFinder) for f in sys.meta_path):
        sys.meta_path.append(_RenamedFinder())
