"""Run a ``launch/`` script under ``torchrun`` from a notebook or a script, and the worker-side
API those scripts use (the lab's own; Megatron's jobs are started by hand or by Slurm).

    >>> from mpu_lab.launcher import run
    >>> job = run("collectives.py", ["--test", "copy"], nproc=8)     # doctest: +SKIP
    >>> job.results[5]                                                # doctest: +SKIP

What it does for you, because ``torchrun`` from a notebook is easy to get wrong:

* ``torchrun --standalone``: a free rendezvous port every time, so two notebooks never collide.
* ``OMP_NUM_THREADS`` set (cores / ranks), ``PYTHONUNBUFFERED=1``; each output line is streamed
  as it comes, prefixed with the *global* rank that printed it (``--tee`` plus torchrun's
  ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``), or collated in rank order after the job
  (``show="ranks"``: deterministic, for notebooks that nbval compares).
* The flags checked before anything starts: a script declares ``PRECHECK = "module:function"``
  and :func:`~mpu_lab.launcher.prechecks.precheck` runs that function on the flags.
* Results as Python data: a worker calls :func:`report` with anything JSON-able; ``run``
  returns them in rank order.
* Failure is an exception, :class:`LaunchError`, naming the root-cause rank (the first to fail,
  from torch elastic's error files written by ``@record``) with its traceback. A time limit per
  job; on timeout, error or ``KeyboardInterrupt`` the whole process tree is terminated and
  checked gone — no orphan workers.

Modules: :mod:`~mpu_lab.launcher.worker` (inside a job), :mod:`~mpu_lab.launcher.runner` (the
driver), :mod:`~mpu_lab.launcher.agent` (torchrun's agent forked from a server that imported
torch once), :mod:`~mpu_lab.launcher.rank_server`, :mod:`~mpu_lab.launcher.rank_client` and
:mod:`~mpu_lab.launcher.fresh_rank` (on a machine with no GPU, the ranks forked too),
:mod:`~mpu_lab.launcher.prechecks` (a script's flags checked before it starts),
:mod:`~mpu_lab.launcher.process_tree` (finding and stopping a job's processes, also
for the lab kit), :mod:`~mpu_lab.launcher.pump` (a child's output, line by line),
:mod:`~mpu_lab.launcher.diagnosis`.
"""
from mpu_lab.launcher.paths import LAUNCH_DIR, REPO_ROOT, RESULT_DIR_ENV, job_pythonpath
from mpu_lab.launcher.prechecks import precheck, precheck_spec, resolve_precheck, script_prechecks
from mpu_lab.launcher.process_tree import descendants, kill_tree
from mpu_lab.launcher.runner import (
    LaunchError,
    LaunchResult,
    LaunchTimeout,
    max_ranks,
    resolve_script,
    run,
    torchrun_command,
)
from mpu_lab.launcher.worker import entrypoint, gather_lines, report

__all__ = [
    "LAUNCH_DIR", "REPO_ROOT", "RESULT_DIR_ENV", "job_pythonpath", "descendants", "kill_tree",
    "LaunchError", "LaunchResult", "LaunchTimeout", "max_ranks", "precheck", "precheck_spec",
    "resolve_precheck", "resolve_script", "run", "script_prechecks", "torchrun_command",
    "entrypoint", "gather_lines", "report",
]
