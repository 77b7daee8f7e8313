"""The inner loop, ``python -m pytest -m "not slow"``, selects no notebook and needs at most one
shared multi-rank world."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

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


def test_not_slow_selects_no_notebook_and_one_shared_world_at_most(tmp_path):
    """One collection of the whole suite with ``-m "not slow"``, in a separate pytest process,
    through a tiny plugin that lists each selected and deselected item's fixtures and markers."""
    (tmp_path / "selected_lister.py").write_text(LISTER)
    out = tmp_path / "selected.json"
    env = dict(os.environ, SELECTED_ITEMS_FILE=str(out),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0",
                           "-p", "no:cacheprovider", "-p", "selected_lister", "-m", "not slow"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(out.read_text())
    selected, deselected = found["selected"], found["deselected"]

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
