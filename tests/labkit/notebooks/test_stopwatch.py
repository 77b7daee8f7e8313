"""The learner's stopwatch (mpu_lab.labkit.notebooks.stopwatch): sittings timed with a clock we
set by hand, recorded from a real IPython shell's post_run_cell events, and the medians an
instructor prints from several learners' files, each worked by hand; and only people are timed:
a notebook run by papermill, nbclient or nbval records nothing, whatever the environment says."""
import json
import os
import pathlib
import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from mpu_lab.labkit.notebooks import sizing, stopwatch


def _lab(folder: pathlib.Path, name="05_demo") -> pathlib.Path:
    nb = new_notebook()
    nb.cells = [new_code_cell("world_size = 2", metadata={"tags": ["parameters"]}),
                new_markdown_cell("# Lab 07"),
                new_code_cell("x = 1"),
                new_code_cell("y = x + 1\n"),
                new_code_cell("def my_f(x):\n    pass"),             # a stub, edited
                new_code_cell("answer = None\ncheck_it(answer)"),    # a question, edited
                new_markdown_cell("## Going further: more"),
                new_code_cell("z = 3")]
    path = folder / f"{name}.ipynb"
    nbformat.write(nb, str(path))
    return path


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_core_cells_stop_at_going_further_and_leave_out_what_the_learner_edits(tmp_path):
    assert stopwatch.core_cells(_lab(tmp_path)) == ["x = 1", "y = x + 1"]


def test_a_pause_longer_than_a_break_is_not_counted_and_an_edited_cell_is_not_reached(tmp_path):
    clock = _Clock()
    sitting = stopwatch.Sitting("05_demo", ["x = 1", "y = x + 1"], tmp_path / "t.json", clock)
    clock.t += 60
    sitting.cell_ran("x = 1")                   # 60 s of work
    clock.t += stopwatch.BREAK_S + 1
    sitting.cell_ran("y = x + 2")               # after a break; the learner edited the cell
    assert (sitting.active_s, sitting.reached, sitting.done) == (60, 0, False)
    clock.t += 30
    sitting.cell_ran("y = x + 1  ")             # 30 s more; the last core cell as written
    assert (sitting.active_s, sitting.reached, sitting.done) == (90, 1, True)
    saved = json.loads((tmp_path / "t.json").read_text())["sittings"]
    assert list(saved.values()) == [{"lab": "05_demo", "started": 1000.0, "active_s": 90.0,
                                     "reached": 1, "core_cells": 2, "done": True}]


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    yield shell
    InteractiveShell.clear_instance()


def test_a_real_shell_records_the_cells_it_runs(tmp_path, monkeypatch, shell):
    _lab(tmp_path)
    log = tmp_path / "times.json"
    monkeypatch.setenv(stopwatch.TIMES_ENV, str(log))
    monkeypatch.setenv(stopwatch.OFF_ENV, "1")
    assert stopwatch.start("05_demo", tmp_path, ipython=shell) is not None
    shell.run_cell("x = 1")
    shell.run_cell("y = x + 1")
    sitting, = json.loads(log.read_text())["sittings"].values()
    assert (sitting["lab"], sitting["reached"], sitting["done"]) == ("05_demo", 1, True)
    # running the resolve cell again starts a new sitting; the old one stays on record
    stopwatch.start("05_demo", tmp_path, ipython=shell)
    shell.run_cell("x = 1")
    records = json.loads(log.read_text())["sittings"]
    assert sorted(s["reached"] for s in records.values()) == [0, 1]


def test_nothing_is_recorded_when_the_stopwatch_is_off_or_outside_ipython(tmp_path, monkeypatch,
                                                                          shell):
    _lab(tmp_path)
    monkeypatch.setenv(stopwatch.TIMES_ENV, str(tmp_path / "times.json"))
    monkeypatch.setenv(stopwatch.OFF_ENV, "0")     # as regenerate and the test plugin set it
    assert stopwatch.start("05_demo", tmp_path, ipython=shell) is None
    shell.run_cell("x = 1")
    assert not (tmp_path / "times.json").exists()


def _learner(path, sittings):
    path.write_text(json.dumps({"sittings": {str(i): s for i, s in enumerate(sittings)}}))
    return path


def _s(lab, started, active_s, done):
    return {"lab": lab, "started": started, "active_s": active_s, "reached": 0,
            "core_cells": 9, "done": done}


def test_measured_minutes_add_sittings_up_to_the_first_that_finished(tmp_path):
    a = _learner(tmp_path / "a.json", [
        _s("05_demo", 1, 600, False),      # 10 min, stopped half way
        _s("05_demo", 2, 900, True),       # 15 min more, to the end of the core: 25 min
        _s("05_demo", 3, 300, True),       # came back later: not part of working through it
        _s("06_other", 4, 1200, False)])   # never reached the end of its core: left out
    b = _learner(tmp_path / "b.json", [_s("05_demo", 1, 1800, True)])   # 30 min
    assert stopwatch.measured_minutes([a, b]) == {"05_demo": [25.0, 30.0]}
    assert stopwatch.median_minutes([a, b]) == {"05_demo": (27.5, 2)}


def test_start_here_shows_the_median_beside_the_estimate(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sizing, "TIMES_FILE", tmp_path / "none.json")
    lab = _lab(tmp_path)
    b = _learner(tmp_path / "b.json", [_s("05_demo", 1, 1800, True)])
    c = _learner(tmp_path / "c.json", [_s("05_demo", 1, 2400, True)])
    sizing.print_lab_sizes([lab], [b, c])
    out = capsys.readouterr().out
    assert "measured" in out and "35 min (2)" in out      # median of 30 and 40 minutes


def test_start_here_shows_your_own_time_only_while_the_stopwatch_is_on(tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.setattr(sizing, "TIMES_FILE", tmp_path / "none.json")
    lab = _lab(tmp_path)
    monkeypatch.setenv(stopwatch.TIMES_ENV, str(_learner(tmp_path / "mine.json",
                                                          [_s("05_demo", 1, 1500, True)])))
    monkeypatch.setenv(stopwatch.OFF_ENV, "1")
    sizing.print_lab_sizes([lab])
    assert "yours" in (out := capsys.readouterr().out) and "25 min" in out
    monkeypatch.setenv(stopwatch.OFF_ENV, "0")      # nbval: Start_Here's stored table holds
    sizing.print_lab_sizes([lab])
    assert "yours" not in capsys.readouterr().out


# --------------------------------------------------------------------------- people only
class _Kernel:
    """What ``stopwatch`` asks of an ipykernel: the request now being handled."""

    def __init__(self, allow_stdin):
        self.allow_stdin = allow_stdin

    def get_parent(self):
        return {"msg_type": "execute_request", "content": {"code": "...",
                                                          "allow_stdin": self.allow_stdin}}


class _KernelShell:
    """A real shell's events, with the kernel a frontend's request would show."""

    def __init__(self, shell, allow_stdin):
        self.events, self.kernel = shell.events, _Kernel(allow_stdin)


@pytest.mark.parametrize("allow_stdin,recorded", [(True, True), (False, False)],
                         ids=["a-person's-frontend", "an-executor"])
def test_a_kernel_records_the_cells_a_person_sends_and_not_an_executors(
        tmp_path, monkeypatch, shell, allow_stdin, recorded):
    _lab(tmp_path)
    log = tmp_path / "times.json"
    monkeypatch.setenv(stopwatch.TIMES_ENV, str(log))
    monkeypatch.setenv(stopwatch.OFF_ENV, "1")      # on, as far as the environment goes
    ipython = _KernelShell(shell, allow_stdin)
    assert (stopwatch.start("05_demo", tmp_path, ipython=ipython) is not None) == recorded
    assert stopwatch.run_by_executor(ipython) == (not recorded)
    shell.run_cell("x = 1")
    assert log.exists() == recorded


def _caller(folder: pathlib.Path) -> pathlib.Path:
    """A notebook whose first cell starts a sitting with ``folder/05_demo.ipynb`` (as a lab's
    resolve cell does) and whose second is one of that lab's core cells."""
    _lab(folder)
    nb = new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                               "language": "python"}})
    start = f"sitting = stopwatch.start('05_demo', pathlib.Path({str(folder)!r}))"
    nb.cells = [new_code_cell("import pathlib\nfrom mpu_lab.labkit.notebooks import stopwatch\n"
                              + start),
                new_code_cell("x = 1")]
    path = folder / "caller.ipynb"
    nbformat.write(nb, str(path))
    return path


@pytest.fixture
def times_on(tmp_path, monkeypatch):
    """The stopwatch's file in ``tmp_path`` and the environment saying "on", as a learner's
    shell has it: only the kernel's own test may keep an executor's run off the record."""
    log = tmp_path / "times.json"
    monkeypatch.setenv(stopwatch.TIMES_ENV, str(log))
    monkeypatch.setenv(stopwatch.OFF_ENV, "1")
    return log


def test_a_papermill_run_records_nothing(tmp_path, times_on):
    nb = _caller(tmp_path)
    subprocess.run([sys.executable, "-m", "papermill", "--log-level", "ERROR", str(nb),
                    str(tmp_path / "out.ipynb")], check=True, cwd=tmp_path, timeout=300)
    assert nbformat.read(str(tmp_path / "out.ipynb"), as_version=4).cells[1].execution_count
    assert not times_on.exists()


@pytest.mark.slow
def test_an_nbclient_run_records_nothing(tmp_path, times_on):
    from nbclient import NotebookClient
    nb = nbformat.read(str(_caller(tmp_path)), as_version=4)
    NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert nb.cells[1].execution_count == 2
    assert not times_on.exists()


@pytest.mark.slow
def test_an_nbval_run_records_nothing(tmp_path, times_on):
    # nbval without this project's pytest plugin (which would turn the stopwatch off)
    nb = _caller(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--nbval-lax", "-c", os.devnull, "--rootdir", str(tmp_path), str(nb)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout + proc.stderr
    assert not times_on.exists()


@pytest.mark.slow
def test_a_kernel_driven_like_a_persons_frontend_records(tmp_path, times_on):
    # the positive control of the three above: the same kernel and cells, sent by a client
    # that answers input() as JupyterLab does (allow_stdin=True)
    from jupyter_client.manager import start_new_kernel
    nb = nbformat.read(str(_caller(tmp_path)), as_version=4)
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        for cell in nb.cells:
            reply = kc.execute_interactive(cell.source, allow_stdin=True, timeout=120,
                                           output_hook=lambda msg: None)
            assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    sitting, = json.loads(times_on.read_text())["sittings"].values()
    assert (sitting["lab"], sitting["reached"], sitting["done"]) == ("05_demo", 0, False)
