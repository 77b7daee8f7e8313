"""Temporary re-export of :mod:`mpu_lab.launcher` under its former name ``mpu_lab.launch``
(every name the former module had, private ones used by the tests included), until the
integrator replaces it with a compatibility alias. New code imports :mod:`mpu_lab.launcher`.
``PRECHECKS`` is now built from the ``PRECHECK`` strings the ``launch/`` scripts declare."""
import subprocess  # noqa: F401  (tests patch launch.subprocess.Popen)

from mpu_lab.launcher.diagnosis import (  # noqa: F401
    _C10D_FILES,
    _COLLECTIVE_TIMEOUT,
    _FRAME,
    _SECONDARY,
    _collective_in,
    _diagnose,
    _exit_codes,
    _first_failed_rank,
    _own_frames,
    _root_cause,
    _short,
    _traceback_from_lines,
    _where,
)
from mpu_lab.launcher.paths import LAUNCH_DIR, REPO_ROOT, RESULT_DIR_ENV  # noqa: F401
from mpu_lab.launcher.process_tree import _alive, _children_map, descendants, kill_tree  # noqa: F401
from mpu_lab.launcher.runner import (  # noqa: F401
    _PREFIX,
    LaunchError,
    LaunchResult,
    LaunchTimeout,
    max_ranks,
    precheck,
    precheck_spec,
    resolve_precheck,
    resolve_script,
    run,
    script_prechecks,
    torchrun_command,
)
from mpu_lab.launcher.worker import _dump_stack_on_sigterm, entrypoint, gather_lines, report  # noqa: F401

PRECHECKS = script_prechecks()
