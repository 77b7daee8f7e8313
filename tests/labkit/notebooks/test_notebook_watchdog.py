"""The notebook watchdog (mpu_lab/labkit/notebooks/watchdog.py): a kernel that stops answering
(no output, no CPU time while a cell executes) is killed with everything it started and the
notebook is retried once; a cell that is long but busy is left alone.

A cell that sleeps stands in for the lost reply: an idle kernel with no output, as the kernel
that once waited 900 s for a reply at 8 ranks. ``stall_s=3`` keeps each test to seconds.
"""
import io
import re
import signal
import subprocess
import sys
import time

import nbformat
import psutil
import pytest

from mpu_lab.labkit import REPO_ROOT, notebooks

pytestmark = pytest.mark.slow        # each test runs notebook kernels of its own


def write_nb(path, sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = dict(notebooks.KERNELSPEC)
    nbformat.write(nb, str(path))


def pids_in(path):
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_an_idle_kernel_is_killed_with_its_children_retried_once_and_reported(tmp_path):
    pids = tmp_path / "pids.txt"
    # The kernel records its PID and starts a child in a session of its own (as torchrun jobs
    # and ipyparallel engines are), then waits in silence for a reply that never comes.
    nb = tmp_path / "stuck.ipynb"
    write_nb(nb, ["print('before the stall')",
                  "import os, subprocess, sys, time\n"
                  "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
                  " start_new_session=True)\n"
                  f"open({str(pids)!r}, 'a').write(f'{{os.getpid()}} {{child.pid}} ')\n"
                  "time.sleep(30)"])
    before = nb.read_bytes()
    log = io.StringIO()
    start = time.monotonic()
    with pytest.raises(SystemExit, match="failed: stuck.ipynb"):
        notebooks.regenerate([nb], out=log, stall_s=3)
    elapsed = time.monotonic() - start
    text = log.getvalue()
    # Two tries of: kernel start (seconds, more on a loaded machine) + 3 s of stall + the kill.
    # Undetected, each try would sleep its 30 s out and the notebook would pass.
    assert elapsed < 45, (elapsed, text)
    assert all(int(s) <= 5 for s in re.findall(r"no output for (\d+) s", text)), text
    assert nb.read_bytes() == before                         # a failure is not written back
    lines = text.splitlines()
    assert "stuck.ipynb: the kernel stopped answering: cell 1 ('import os, subprocess, sys, " \
        "time') executing" in lines[0], text
    assert "retrying (1 of 1)" in lines[0]
    # where the kernel's main thread waited, from its own stack dump (the cell's 4th line)
    assert "the kernel was at: the cell:4 in <module>; retrying" in lines[0], text
    assert "FAILED, not written" in lines[1] and "gave up after 2 tries" in lines[1], text
    seen = pids_in(pids)
    assert len(seen) == 4, seen                               # two tries, kernel + child each
    assert not [p for p in seen if psutil.pid_exists(p) and
                psutil.Process(p).status() != psutil.STATUS_ZOMBIE], "processes left behind"


def test_a_long_cell_that_keeps_the_cpu_busy_is_not_killed(tmp_path):
    nb = tmp_path / "busy.ipynb"
    write_nb(nb, ["import time\nt = time.monotonic()\nwhile time.monotonic() - t < 6:\n"
                  "    sum(range(1000))\nprint('done')"])
    log = io.StringIO()
    times = notebooks.regenerate([nb], out=log, stall_s=3)
    assert set(times) == {"busy.ipynb"} and times["busy.ipynb"] >= 6, log.getvalue()
    assert "stopped answering" not in log.getvalue()
    assert nbformat.read(nb, 4).cells[0].outputs[0].text == "done\n"


def test_a_regeneration_stopped_by_sigterm_leaves_no_process_behind(tmp_path):
    """``kill`` of a regeneration (SIGTERM: a cancelled CI job, a time limit) ends it through
    the watchdog's cleanup: the kernel and what it started in a session of its own are gone,
    where Python's default SIGTERM would have ended only the parent and orphaned them."""
    pids = tmp_path / "pids.txt"
    nb = tmp_path / "long.ipynb"
    write_nb(nb, ["import os, subprocess, sys, time\n"
                  "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(90)'],"
                  " start_new_session=True)\n"
                  f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
                  "time.sleep(90)"])
    code = ("import pathlib\nfrom mpu_lab.labkit import notebooks\n"
            "from mpu_lab.labkit.notebooks.watchdog import terminate_as_exit\n"
            "with terminate_as_exit():\n"
            f"    notebooks.regenerate([pathlib.Path({str(nb)!r})], stall_s=0)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rc, left = None, []
    try:
        deadline = time.monotonic() + 90
        while len(pids_in(pids)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert len(pids_in(pids)) == 2, "the notebook's cell never ran"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        left = [p for p in pids_in(pids) if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        for p in left:   # whatever the outcome, nothing of this test outlives it
            psutil.Process(p).kill()
    assert left == [], "processes left behind"
    assert rc == 128 + signal.SIGTERM   # ended through SystemExit, not by the signal itself


def test_the_output_widget_stand_in_of_papermill_echoes_nothing_to_the_kernel(monkeypatch):
    """nbclient's stand-in for an Output widget sends each captured output back to the kernel
    on the shell channel while the cell's execute_reply is awaited on it: with two notebooks
    regenerated at once, 3 of 8 runs of a notebook of 40 widget cells stalled on a widget cell
    (nbclient issue #312); the watchdog's child turns the echo off (0 of 8)."""
    from jupyter_client.session import Session
    from nbclient.output_widget import OutputWidget

    from mpu_lab.labkit.notebooks import watchdog

    monkeypatch.setattr(OutputWidget, "sync_state", OutputWidget.sync_state)   # restored after
    sent = []

    class Shell:
        def send(self, msg):
            sent.append(msg)

    class Client:
        shell_channel, session = Shell(), Session()

    def figure():
        return {"header": {"msg_type": "display_data"}, "msg_type": "display_data",
                "parent_header": {"msg_id": "cell"}, "metadata": {},
                "content": {"data": {"text/plain": "<Figure>"}, "metadata": {}}}

    widget = OutputWidget("comm-1", {"outputs": []}, Client(), executor=None)
    widget.output([], figure(), None, 0)
    assert [m["msg_type"] for m in sent] == ["comm_msg"]     # nbclient as it comes: the echo
    watchdog.no_output_widget_echo()
    widget.output([], figure(), None, 0)
    assert len(sent) == 1 and len(widget.outputs) == 2       # captured, not echoed
