"""Where the launcher finds things: the repository, its ``launch/`` scripts, the environment
variable that tells a worker where to write its results, and the ``PYTHONPATH`` of the
processes a job starts (the lab's own; no Megatron counterpart)."""
import os
import pathlib
from typing import Optional

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
LAUNCH_DIR = REPO_ROOT / "launch"
RESULT_DIR_ENV = "MPU_LAB_RESULT_DIR"
# first on that PYTHONPATH: its sitecustomize raises the garbage collector's first threshold
# and skips its last collection at exit, which takes about a quarter off the CPU of a small
# job's processes (startup/sitecustomize.py says why)
STARTUP_DIR = pathlib.Path(__file__).resolve().parent / "startup"


def job_pythonpath(existing: Optional[str] = None) -> str:
    """The ``PYTHONPATH`` of a process a job starts: :data:`STARTUP_DIR`, this checkout (so a
    rank imports this checkout's ``mpu_lab``), then ``existing``, the caller's own."""
    return os.pathsep.join(p for p in (str(STARTUP_DIR), str(REPO_ROOT), existing) if p)
