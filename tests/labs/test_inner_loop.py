"""The inner loop, ``python -m pytest -m "not slow"``, selects no notebook and needs at most one
shared multi-rank world; and every file that uses a shared job is one unit of work with the
others that use it (tests/conftest.py), so that the job starts once per run, not once per
worker."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARED_WORLDS = {"four_rank_job", "eight_rank_job", "grading_world"}

LISTER = '''
import json, os

DESELECTED = []


def describe(item):
    return dict(fixtures=sorted(getattr(item, "fixturenames", ())),
                markers=sorted({m.name for m in item.iter_markers()}))


def pytest_deselected(items):
    DESELECTED.extend(items)


def pytest_collection_finish(session):
    with open(os.environ["SELECTED_ITEMS_FILE"], "w") as f:
        json.dump({"selected": {item.nodeid: describe(item) for item in session.items},
                   "deselected": {item.nodeid: describe(item) for item in DESELECTED}}, f)
'''


def is_notebook_cell(nodeid: str) -> bool:
    return nodeid.split("::")[0].endswith(".ipynb")


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """One collection of the whole suite with ``-m "not slow"``, in a separate pytest process,
    through a tiny plugin that lists each selected and deselected item's fixtures and markers."""
    tmp_path = tmp_path_factory.mktemp("inner_loop")
    (tmp_path / "selected_lister.py").write_text(LISTER)
    out = tmp_path / "selected.json"
    env = dict(os.environ, SELECTED_ITEMS_FILE=str(out),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0",
                           "-p", "no:cacheprovider", "-p", "selected_lister", "-m", "not slow"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_not_slow_selects_no_notebook_and_one_shared_world_at_most(collected):
    selected, deselected = collected["selected"], collected["deselected"]

    assert len(selected) > 300                       # the package tests are there
    assert [n for n in selected if is_notebook_cell(n)] == []
    worlds = {name for item in selected.values() for name in item["fixtures"]
              if name in SHARED_WORLDS}
    assert len(worlds) <= 1, f"the inner loop starts {sorted(worlds)}"

    # every notebook cell was collected, and left out as notebook and slow
    notebook = {n: item for n, item in deselected.items() if is_notebook_cell(n)}
    assert [n for n, item in notebook.items()
            if not {"notebook", "slow"} <= set(item["markers"])] == []
    expected = {p.relative_to(ROOT).as_posix()
                for p in [ROOT / "Start_Here.ipynb", *(ROOT / "labs").glob("*.ipynb")]}
    assert {n.split("::")[0] for n in notebook} == expected


# the session fixtures that start one job each, and the unit of work (tests/conftest.py) that
# every file using them must belong to
JOB_UNITS = {"four_rank_job": "4-rank job", "eight_rank_job": "8-rank job"}


def test_every_file_using_a_shared_job_is_in_its_unit(collected):
    """A file that uses a session job but is a unit of its own can be handed to the other
    pytest-xdist worker, which then starts the same job again (a 4-rank job is about 80 CPU-s
    on the 2-core machine): test_recompute_mp.py did, until it joined the 4-rank unit."""
    from conftest import _unit   # tests/conftest.py, on sys.path under pytest's rootdir

    items = {**collected["selected"], **collected["deselected"]}
    wrong = sorted({(nodeid.split("::")[0], fixture, _unit(nodeid))
                    for nodeid, item in items.items() for fixture in item["fixtures"]
                    if fixture in JOB_UNITS and _unit(nodeid) != JOB_UNITS[fixture]})
    assert wrong == [], "files whose unit is not their job's (file, job, unit): " + repr(wrong)
