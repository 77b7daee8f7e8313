"""mpu_lab.launcher.process_tree and .pump: the one way the launcher, the notebook watchdog and
the playground find a child's processes, stop them and read its output.

Each case starts small Python processes that write their PIDs to a file; whether a PID is gone
is read independently of the module under test (``/proc/PID/stat``: absent, or state Z).
"""
import os
import pathlib
import subprocess
import sys
import time
import uuid

from mpu_lab.launcher import process_tree
from mpu_lab.launcher.pump import pump_lines


def gone(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def start(code: str, pid_file: pathlib.Path, expect: int, env=None) -> subprocess.Popen:
    """Run ``code`` (``PIDS`` names the PID file) and wait until ``expect`` PIDs are in it."""
    proc = subprocess.Popen([sys.executable, "-c", f"PIDS = {str(pid_file)!r}\n" + code],
                            env=env, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if pid_file.exists() and len(pid_file.read_text().split()) >= expect:
            return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"the processes never started ({pid_file})")


def pids(pid_file: pathlib.Path):
    return [int(p) for p in pid_file.read_text().split()]


GRANDCHILD = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],
                         start_new_session=True)
open(PIDS, 'a').write(f'{os.getpid()} {child.pid} ')
time.sleep(60)
"""


def test_kill_tree_stops_a_child_and_its_grandchild_in_a_session_of_its_own(tmp_path):
    proc = start(GRANDCHILD, tmp_path / "pids", 2)
    child, grandchild = pids(tmp_path / "pids")
    assert child == proc.pid and process_tree.descendants(proc.pid) == [grandchild]
    t0 = time.monotonic()
    stopped = process_tree.kill_tree(proc, grace_s=5.0)
    assert time.monotonic() - t0 < 4.0            # both end on SIGTERM: no grace spent
    assert stopped == sorted([child, grandchild])
    assert gone(child) and gone(grandchild)
    assert proc.returncode is not None            # reaped


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    code = ("import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "open(PIDS, 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    proc = start(code, tmp_path / "pids", 1)
    t0 = time.monotonic()
    assert process_tree.kill_tree(proc, grace_s=1.0) == [proc.pid]
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 5.0, elapsed
    assert proc.returncode == -9                  # SIGKILL, and the code kept (not 0)


def test_a_zombie_counts_as_gone_and_costs_no_grace(tmp_path):
    # the child starts a grandchild that exits at once and is never reaped: a zombie
    code = ("import os, subprocess, sys, time\n"
            "z = subprocess.Popen([sys.executable, '-c', 'pass'])\n"
            "open(PIDS, 'w').write(f'{os.getpid()} {z.pid}')\ntime.sleep(60)\n")
    proc = start(code, tmp_path / "pids", 2)
    _, zombie = pids(tmp_path / "pids")
    deadline = time.monotonic() + 30
    while not gone(zombie) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_tree.descendants(proc.pid) == []
    t0 = time.monotonic()
    process_tree.kill_tree(proc, grace_s=5.0)
    assert time.monotonic() - t0 < 4.0


def test_a_process_started_while_stopping_is_found_by_its_tag_and_stopped(tmp_path):
    """The child answers SIGTERM by starting one more process in a session of its own and
    exiting: an orphan no parent links back to, found by the environment tag it inherited."""
    tag = uuid.uuid4().hex
    code = ("import os, signal, subprocess, sys, time\n"
            "def last_word(*_):\n"
            "    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
            " start_new_session=True)\n"
            "    open(PIDS, 'a').write(f' {p.pid}')\n"
            "    os._exit(0)\n"
            "signal.signal(signal.SIGTERM, last_word)\n"
            "open(PIDS, 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    env = dict(os.environ, MPU_LAB_TEST_TAG=tag)
    proc = start(code, tmp_path / "pids", 1, env=env)
    stopped = process_tree.kill_tree(
        proc, grace_s=2.0, also=lambda: process_tree.tagged("MPU_LAB_TEST_TAG", tag))
    child, orphan = pids(tmp_path / "pids")
    assert stopped == sorted([child, orphan])
    assert gone(orphan)
    assert process_tree.tagged("MPU_LAB_TEST_TAG", tag) == []


def test_pump_lines_hands_over_every_line_then_none():
    proc = subprocess.Popen([sys.executable, "-c", "print('a'); print('b', end='')"],
                            stdout=subprocess.PIPE, text=True)
    lines = pump_lines(proc.stdout)
    got = [lines.get(timeout=30) for _ in range(3)]
    proc.wait()
    assert got == ["a\n", "b", None]
