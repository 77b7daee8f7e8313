"""mpu_lab.launcher: torchrun from Python with results, clear failures and no orphans.

The failure cases (a rank raising, hanging or skipping a collective, KeyboardInterrupt, many
launches at once or in a row) are in tests/launcher/test_reliability.py, which watches the workers by
PID and times each case.
"""
import pathlib
import re
import sys
import threading
import time
import uuid

import pytest

from mpu_lab.launcher import LaunchError, LaunchTimeout, prechecks, run

PROBE = pathlib.Path(__file__).resolve().parents[1] / "mp" / "launch_probe.py"
pytestmark = pytest.mark.slow


def processes_with(marker: str):
    """PIDs whose command line contains ``marker`` (the job's workers and torchrun)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker in cmdline and state != "Z":
                found.append(int(entry.name))
    return found


def test_results_come_back_in_rank_order_with_rank_prefixed_lines(capsys):
    job = run(PROBE, nproc=4, show="ranks", timeout_s=120)
    assert [r["rank"] for r in job.results] == [0, 1, 2, 3]
    assert all(r["sum"] == 24.0 and r["world_size"] == 4 for r in job.results)  # 6, then 4 x 6
    assert all(r["backend"] == "gloo" for r in job.results)
    # every rank started through the launcher's start-up hook (launcher/startup/sitecustomize.py)
    assert all(r["gc_threshold"][0] == 20_000 for r in job.results)
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"[rank{r}] rank {r} of 4: all-reduce of ranks = 6" for r in range(4)]
    assert job.output(2) == ["rank 2 of 4: all-reduce of ranks = 6"]


def test_job_past_its_time_limit_is_killed_with_every_worker():
    # The limit leaves both ranks time to import torch and reach their places (rank 0 in
    # all_reduce, rank 1 asleep) while the other xdist worker keeps both cores busy: at 8 s
    # they were sometimes still importing, and then nobody can say where they were; at 20 s
    # too, on a machine loaded by notebooks and other jobs (no line printed in 20 s). The
    # wait is idle time: it costs the suite wall time on one worker, not CPU.
    marker = f"--marker={uuid.uuid4().hex}"
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as err:
        run(PROBE, [marker], nproc=2, show="none", env={"HANG_RANK": "1"}, timeout_s=40)
    assert time.monotonic() - start < 40 + 10
    assert "timeout_s=40" in str(err.value)
    assert processes_with(marker) == []
    # where each rank was when it was stopped (faulthandler's dump on SIGTERM)
    message = str(err.value)
    assert re.search(r"rank 0 was stopped at tests/mp/launch_probe\.py:\d+ in main", message), message
    assert re.search(r"rank 1 was stopped at tests/mp/launch_probe\.py:\d+ in main", message), message
    assert err.value.states[0] != err.value.states[1]   # all_reduce vs sleep


@pytest.mark.parametrize("kwargs,error,needle", [
    (dict(nproc=0), ValueError, "nproc must be a positive integer, got 0"),
    (dict(nproc=10_000), ValueError, "nproc=10000 ranks requested"),
    (dict(nproc=2, show="loud"), ValueError, "show must be"),
    (dict(nproc=2, timeout_s=0), ValueError, "timeout_s must be > 0"),
])
def test_bad_launch_arguments_raise_before_anything_starts(kwargs, error, needle):
    with pytest.raises(error) as err:
        run(PROBE, **kwargs)
    assert needle in str(err.value)


def test_unknown_script_names_the_available_ones():
    with pytest.raises(FileNotFoundError) as err:
        run("no_such_script.py", nproc=2)
    assert "launch/ folder has" in str(err.value)


def test_half_written_lines_are_joined_to_their_rank_not_glued_to_another():
    """torchrun copies a worker's output as it grows: a half-written line comes out prefixed
    and the next rank's prefix follows on the same line (seen in a stored notebook output as
    a stray '[rank1]:'); the rest of the half line arrives later."""
    from mpu_lab.launcher.runner import RankLines
    split = RankLines()
    assert split.feed("[rank0]:hello\n") == [(0, "hello")]
    assert split.feed("[rank1]:partial, [rank0]:a whole line\n") == [(0, "a whole line")]
    assert split.feed("[rank1]:then its end\n") == [(1, "partial, then its end")]
    assert split.feed("torchrun's own line\n") == [(None, "torchrun's own line")]
    assert split.feed("[rank2]:no end yet") == []
    assert split.flush() == [(2, "no end yet")]


def test_prechecks_of_jobs_launched_side_by_side_leave_stdout_and_stderr_as_they_were(
        monkeypatch):
    # Each pre-check swallows what the check prints (argparse's usage) by redirecting the
    # process's sys.stdout / sys.stderr. Lab 04 launches two jobs from two threads: without a
    # lock the redirections interleave and the notebook's stdout stays a dead buffer (seen:
    # every later cell printed nothing).
    def slow_check(argv, nproc, cwd=None):
        print("usage: ...")
        time.sleep(0.02)

    monkeypatch.setattr(prechecks, "precheck_spec", lambda path: "x:y")
    monkeypatch.setattr(prechecks, "resolve_precheck", lambda spec: slow_check)
    before = sys.stdout, sys.stderr
    threads = [threading.Thread(target=prechecks.precheck, args=(pathlib.Path("x.py"), [], 2))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (sys.stdout, sys.stderr) == before


def test_an_environment_inside_the_repository_is_not_the_repositorys_code():
    """The README puts the virtual environment in the repository (``.venv``): torch's frames
    there are torch's (lab 17's stacks and the launcher's diagnosis name them as torch's,
    without line numbers), not files of this repository."""
    from mpu_lab.labkit.debugging import tools as debugging
    from mpu_lab.launcher import REPO_ROOT, diagnosis
    torch_file = str(REPO_ROOT / ".venv" / "lib" / "python3.11" / "site-packages" / "torch"
                     / "distributed" / "distributed_c10d.py")
    own = str(REPO_ROOT / "mpu_lab" / "core" / "comm" / "__init__.py")
    engine = str(REPO_ROOT / "mpu_lab" / "labkit" / "playground" / "engine.py")
    dump = ("Current thread 0x00007f00 (most recent call first):\n"
            f'  File "{torch_file}", line 2501 in all_reduce\n'
            f'  File "{own}", line 80 in all_reduce\n'
            f'  File "{engine}", line 100 in run_on_engine\n')
    assert debugging.format_stack(dump) == [
        "all_reduce           (torch/distributed/distributed_c10d.py)",
        "all_reduce           (mpu_lab/core/comm/__init__.py:80)"]
    assert diagnosis.short_path(torch_file) == "distributed_c10d.py"
    assert diagnosis.short_path(own) == "mpu_lab/core/comm/__init__.py"


CONNECT_FLAKE = PROBE.parent / "connect_flake.py"


def test_a_job_whose_ranks_could_not_connect_is_started_once_more(tmp_path, capsys):
    """gloo's connectFullMesh failure (a peer closed a connection while a group was set up, a
    transient of a loaded machine) gets one more start; the second start's reports come back."""
    starts = tmp_path / "starts"
    job = run(CONNECT_FLAKE, nproc=2, show="none", timeout_s=120,
              env={"STARTS_FILE": str(starts)})
    assert [r["rank"] for r in job.results] == [0, 1]
    assert starts.read_text().count("start") == 2
    assert "the ranks could not connect to each other" in capsys.readouterr().err


def test_any_other_failure_is_raised_at_once(tmp_path):
    starts = tmp_path / "starts"
    with pytest.raises(LaunchError, match="rank 0 raised first: RuntimeError: a bug of its own"):
        run(CONNECT_FLAKE, nproc=2, show="none", timeout_s=120,
            env={"STARTS_FILE": str(starts), "FAILURE": "a bug of its own"})
    assert starts.read_text().count("start") == 1
