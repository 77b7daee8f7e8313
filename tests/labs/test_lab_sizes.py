"""Every lab is sized for one sitting (issue 29): its core ends with a Summary, the depth after it
sits in "Going further" sections that say the rest of the course does not depend on them, and
the core's estimate (mpu_lab.labkit.notebooks.sizing, itself tested on notebooks counted by
hand) stays within the budget, at the compute recorded by the last re-execution."""
import pathlib
import re

import nbformat
import pytest

from mpu_lab.labkit.notebooks import sizing

LABS = sorted((pathlib.Path(__file__).resolve().parents[2] / "labs").glob("[0-9][0-9]_*.ipynb"))


def _headings(nb):
    return [line[3:] for cell in nb.cells if cell.cell_type == "markdown"
            for line in cell.source.splitlines() if line.startswith("## ")]


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_the_core_ends_with_a_summary_and_only_going_further_follows(path):
    headings = _headings(nbformat.read(str(path), as_version=4))
    assert "Summary" in headings, headings
    cut = headings.index("Summary")
    assert not [h for h in headings[:cut] if h.startswith("Going further")]
    assert [h for h in headings[cut + 1:] if not h.startswith(("Going further", "Sources"))] == []


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_each_going_further_says_the_course_does_not_depend_on_it(path):
    nb = nbformat.read(str(path), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("## Going further"):
            opening = cell.source.split("\n", 1)[-1][:400]
            assert re.search(r"does\s+not\s+depend", opening), cell.source[:200]


# Cores over the budget by the honest count (stored outputs read, a minute per figure), as
# measured when that count arrived, then with the builds' writing time reported beside the core
# and not in it (issue 42): each may only shrink until it fits; the cut (depth moved to Going
# further, or a lab split) is still to do.
# 04_data_parallel: 41 min at its quiet compute (77 s), 46 min at the 372 s its last re-execution
# took on a machine 6x over-subscribed: re-execute it on a quiet machine, then remove it.
OVER_BUDGET_CEILING = {}


def test_every_core_fits_one_sitting_or_shrinks_towards_it():
    sizes = sizing.lab_sizes(LABS)
    assert len(sizes) == len(LABS) >= 14
    grew = {s.name: round(s.core_minutes, 1) for s in sizes
            if s.core_minutes > OVER_BUDGET_CEILING.get(s.name, sizing.CORE_BUDGET_MIN)}
    assert grew == {}, f"cores over their ceiling (budget {sizing.CORE_BUDGET_MIN} min): {grew}"
    fits = [s.name for s in sizes if s.name in OVER_BUDGET_CEILING
            and s.core_minutes <= sizing.CORE_BUDGET_MIN]
    assert fits == [], f"now within the budget: remove from OVER_BUDGET_CEILING: {fits}"


def test_each_marked_build_grades_the_piece_it_names():
    """A ``### Build: <piece>`` section holds a write-the-code exercise (a ``grade(`` call):
    its writing time is what Start_Here prints beside the core."""
    empty = [(s.name, b.name) for s in sizing.lab_sizes(LABS) for b in s.builds
             if b.marked and not b.exercises]
    assert empty == [], f"build sections without a graded exercise: {empty}"
