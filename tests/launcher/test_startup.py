"""The start-up hook of a job's processes (mpu_lab/launcher/startup/sitecustomize.py): a
fresh interpreter started with the job's ``PYTHONPATH`` has the garbage collector's first
threshold raised and the others kept, skips only the last collection at exit, and a
``sitecustomize`` of the caller's own path still runs after it."""
import os
import subprocess
import sys

from mpu_lab.launcher import job_pythonpath
from mpu_lab.launcher.paths import REPO_ROOT, STARTUP_DIR

SHOW = "import gc; print(gc.get_threshold())"


def _python(code, pythonpath=None):
    """``code`` in a fresh interpreter whose ``PYTHONPATH`` is ``pythonpath`` (none: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60, cwd=os.path.dirname(STARTUP_DIR))


def _fresh(pythonpath=None):
    out = _python(SHOW, pythonpath)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_a_job_process_starts_with_the_first_threshold_raised_and_the_others_kept():
    default = eval(_fresh()[0])
    assert default[0] < 20_000                     # Python's own: (700, 10, 10) on 3.11 and 3.12
    raised = eval(_fresh(job_pythonpath())[0])
    assert raised == (20_000, *default[1:])


def test_the_job_path_is_the_hook_then_this_checkout_then_the_callers():
    assert job_pythonpath("/elsewhere").split(os.pathsep) == [str(STARTUP_DIR), str(REPO_ROOT),
                                                              "/elsewhere"]
    assert job_pythonpath().split(os.pathsep) == [str(STARTUP_DIR), str(REPO_ROOT)]


def test_a_sitecustomize_further_down_the_path_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import gc\nprint('theirs ran')\n"
                                               "gc.set_threshold(gc.get_threshold()[0], 7, 7)\n")
    lines = _fresh(job_pythonpath(str(tmp_path)))
    assert lines[0] == "theirs ran"
    assert eval(lines[1]) == (20_000, 7, 7)          # ours first, then theirs on top of it


# A program whose object sits in a reference cycle at exit, a handler of its own, an exit status
EXITING = """
import atexit, os, sys
class Node:
    def __del__(self):
        os.write(1, b"finalized by the last collection\\n")
node = Node(); node.me = node
atexit.register(lambda: print("its own atexit handler ran", flush=True))
print("buffered line, never flushed by hand")
sys.exit(3)
"""


def test_a_job_process_skips_only_the_last_collection_at_exit():
    plain, job = _python(EXITING), _python(EXITING, job_pythonpath())
    # Python's own shutdown collects the cycle; a job's process leaves it to the OS
    assert "finalized by the last collection" in plain.stdout
    assert "finalized by the last collection" not in job.stdout
    for out in (plain, job):
        assert out.returncode == 3
        assert "buffered line, never flushed by hand" in out.stdout
        assert "its own atexit handler ran" in out.stdout
