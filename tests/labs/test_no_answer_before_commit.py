"""Nothing answers a question before the learner commits (issue 38 item 1), on every lab
notebook: the graders declare each graded answer (``leaks.declare_answers`` in each lab's
``exercises`` module, computed from the arguments its check cells pass), and
:func:`~mpu_lab.labkit.notebooks.leaks.notebook_leaks` searches the stored notebook for them
above each answer cell, in the stored outputs and prose anywhere below it, and in reveal cells
stored with outputs. That the search catches each kind of leak is shown on hand-built notebooks in
tests/labkit/notebooks/test_leaks.py.

A small whole number (below 100) is a *weak* match: it shows up in prose for many reasons. Each
weak match that was read and is not the answer is listed in :data:`READ_BY_EYE` with why; any
other weak match fails, to be read."""
import importlib
import pathlib
import pkgutil

import pytest

from mpu_lab import labkit
from mpu_lab.labkit.notebooks import leaks

LABS = sorted((pathlib.Path(__file__).resolve().parents[2] / "labs").glob("[0-9][0-9]_*.ipynb"))

# (lab, question, matched text): weak matches read by eye, with what the number is there.
READ_BY_EYE = {
    ("01", "tp groups crossing a node", "2"): "question 1's p = 2 and its example [1, 2, 3]",
    ("16", "smallest cp", "8"): "t = 8 in the memory table's configurations above it",
    ("16", "best ep", "8"): "Mixtral's E = 8 experts, the model's own size the question needs",
    ("17", "culprit of job 1", "1"): "'job 1' names the job; the report's rank numbers are the "
                                     "evidence the question asks the learner to read",
    ("17", "culprit of job 5", "1"): "the report's rank numbers, the evidence to read",
    ("14", "micro-batches on 16 GPUs", "1"): "TP = 1, the padded vocabulary's setting",
    ("09", "collectives of the loss's backward", "0"): "the forward's all-reduce of the target's "
                                                       "logit, to which every other rank adds 0",
}


def _import_graders():
    """Import every lab package's ``exercises`` module: each declares its answers on import."""
    for info in pkgutil.iter_modules(labkit.__path__):
        if info.ispkg and (pathlib.Path(info.module_finder.path) / info.name
                           / "exercises.py").exists():
            importlib.import_module(f"mpu_lab.labkit.{info.name}.exercises")


_import_graders()


# (lab, question, matched text): a strong match read by eye in an output that varies from run
# to run (a timing), where the same digits mean something else; kept apart from READ_BY_EYE
# because the next run may print other digits.
TIMING_COINCIDENCES = {
    ("04", "optimizer state GB per rank", "3.6"): "a step time in ms in the overlap table",
    ("15", "remedy speed-up p=2 m=8", "1.8"): "an idle % in the profiled runs' kernel table",
}


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_no_answer_is_in_sight_before_the_learner_commits(path):
    found = leaks.notebook_leaks(path)
    unread = [leak for leak in found
              if not (leak.weak and (leak.lab, leak.question, leak.text) in READ_BY_EYE)
              and (leak.lab, leak.question, leak.text) not in TIMING_COINCIDENCES]
    assert unread == [], "\n".join(str(leak) for leak in unread)


def test_every_lab_with_a_check_cell_declares_its_answers():
    """A lab whose notebook grades a question (``check_...(answer``) declares its answers."""
    asking = {p.name[:2] for p in LABS if "check_" in p.read_text() and "(answer" in p.read_text()}
    declared = {a.lab for a in leaks.declared_answers()}
    assert sorted(asking - declared) == [], "labs with questions and no declared answers"


def test_read_by_eye_lists_only_weak_matches_still_found():
    """A READ_BY_EYE entry no longer matched is stale: remove it."""
    found = {(leak.lab, leak.question, leak.text) for path in LABS
             for leak in leaks.notebook_leaks(path) if leak.weak}
    assert sorted(set(READ_BY_EYE) - found) == []
