"""Lab 12's write-the-code exercise on the shared 4-rank grading world, regrouped as 4 pipeline
stages: one stage's ZB-H1 order, run with real tensors and messages. The solution passes; an
order with each W right after its B (1F1B's bubble), one that holds back every W (the bubble
filled, but every micro-batch held), one whose lists wait on each other and one with a W before
its B fail, each naming what went wrong; the stub says there is no answer yet."""
import importlib.util
import linecache
import os
import pathlib

import pytest

from mpu_lab.core.pipeline_parallel.action_lists import zbh1_actions
from mpu_lab.labkit.grader import grade
from mpu_lab.labkit.notebooks.solutions import solution_source
from mpu_lab.labkit.zero_bubble import exercises

OWN_SOLUTION = solution_source("12")

STUB = '''
def my_zbh1_order(stage, num_stages, num_microbatches):
    raise NotImplementedError("start from 1F1B")
'''

ONE_F_ONE_B = '''
def my_zbh1_order(stage, num_stages, num_microbatches):
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("F", k) for k in range(warmup)]
    for k in range(num_microbatches - warmup):
        order += [("F", warmup + k), ("B", k), ("W", k)]
    for k in range(num_microbatches - warmup, num_microbatches):
        order += [("B", k), ("W", k)]
    return order
'''

ALL_W_AT_THE_END = '''
def my_zbh1_order(stage, num_stages, num_microbatches):
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("F", k) for k in range(warmup)]
    for k in range(num_microbatches - warmup):
        order += [("F", warmup + k), ("B", k)]
    order += [("B", k) for k in range(num_microbatches - warmup, num_microbatches)]
    return order + [("W", k) for k in range(num_microbatches)]
'''

# stage 0 waits for B0 before its F1, the next stage for F1 before its B0
DEADLOCK = '''
def my_zbh1_order(stage, num_stages, num_microbatches):
    if stage == 0:
        return [(kind, k) for k in range(num_microbatches) for kind in "FBW"]
    return [("F", k) for k in range(num_microbatches)] + [
        (kind, k) for k in range(num_microbatches) for kind in "BW"]
'''

HOLDS_ONE_MORE = OWN_SOLUTION.replace("held = min(stage, m)",
                                     "held = min(stage + (m > num_stages), m)")
assert HOLDS_ONE_MORE != OWN_SOLUTION

W_BEFORE_B = ONE_F_ONE_B.replace('("B", k), ("W", k)]\n    return', '("W", k), ("B", k)]\n    return')


def _grade(source, world, as_notebook, name="my_zbh1_order"):
    return grade(as_notebook(source)[name], exercises.ZBH1_ORDER, world)


def test_the_solution_is_the_mirrors_zbh1_list_and_the_form_check():
    """Without a world: the solution's order equals the mirror's action list (a second
    writing of the same schedule) for several sizes; what order_problem says."""
    ns = {}
    exec(OWN_SOLUTION, ns)
    for p, m in [(2, 1), (2, 5), (4, 4), (4, 9), (4, 2)]:
        for r in range(p):
            assert ns["solution_zbh1_order"](r, p, m) == [(a.kind, a.microbatch)
                                                         for a in zbh1_actions(p, r, m)]
    assert exercises.order_problem([("F", 0), ("B", 0), ("W", 0)], 1) is None
    assert exercises.order_problem([("F", 0), ("W", 0), ("B", 0)], 1) == \
        "('W', 0) comes before ('B', 0)"
    assert exercises.order_problem([("F", 0), ("B", 0)], 1) == "[('W', 0)] missing"
    assert exercises.order_problem("F0", 1) == \
        "a str, not a list of ('F', k) / ('B', k) / ('W', k)"
    assert exercises.order_problem([("W", 1)], 1) == \
        "item 0 is ('W', 1): each item is ('F', k), ('B', k) or ('W', k) with 0 <= k < m = 1"
    assert exercises.order_text([("F", 0), ("B", 0), ("W", 0)]) == "F0 B0 W0"


def test_the_idle_slot_prediction_check(capsys):
    assert exercises.check_idle_slots(9, "1F1B", 4, 8)
    assert exercises.check_idle_slots([3, 3, 3, 3], "ZBH1", 4, 8)
    assert not exercises.check_idle_slots(9, "ZBH1", 4, 8)
    assert not exercises.check_idle_slots(None, "ZBH1", 4, 8)
    assert "No answer yet" in capsys.readouterr().out


@pytest.mark.slow
def test_the_solution_passes_and_is_saved_beside_1f1b(grading_world, as_notebook, capsys):
    # IPython keeps a cell's text in linecache, which is where the grader reads what it saves
    linecache.cache["<learner cell>"] = (len(OWN_SOLUTION), None,
                                         OWN_SOLUTION.splitlines(keepends=True), "<learner cell>")
    assert _grade(OWN_SOLUTION, grading_world, as_notebook, "solution_zbh1_order")
    out = capsys.readouterr().out
    assert out.startswith("Right: solution_zbh1_order agrees"), out
    assert "saved: my_megatron/schedules.py (solution_zbh1_order)" in out, out
    saved = pathlib.Path(os.environ["MPU_LAB_MY_MEGATRON"]) / "schedules.py"
    spec = importlib.util.spec_from_file_location("learner_schedules", saved)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.solution_zbh1_order(1, 4, 8) == [(a.kind, a.microbatch)
                                                 for a in zbh1_actions(4, 1, 8)]


@pytest.mark.slow
def test_the_stub_has_no_answer_yet(grading_world, as_notebook, capsys):
    assert not _grade(STUB, grading_world, as_notebook)
    assert "No answer yet" in capsys.readouterr().out


@pytest.mark.slow
def test_w_right_after_b_is_1f1bs_bubble(grading_world, as_notebook, capsys):
    assert not _grade(ONE_F_ONE_B, grading_world, as_notebook)
    out = capsys.readouterr().out
    # split but not deferred: B's shorter critical path already saves (6 slots, not 9)
    assert "idle unit slots" in out and "at most 3, got 6" in out and "1F1B leaves 9" in out, out


@pytest.mark.slow
def test_every_w_held_back_delays_the_last_backwards(grading_world, as_notebook, capsys):
    assert not _grade(ALL_W_AT_THE_END, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert "idle unit slots" in out and "at most 3, got 6" in out, out


@pytest.mark.slow
def test_one_w_more_held_back_holds_more_than_1f1b(grading_world, as_notebook, capsys):
    """Right at m = p; at m = 2p + 1 the bubble is ZB-H1's, but rank r holds p + 1."""
    assert not _grade(HOLDS_ONE_MORE, grading_world, as_notebook, "solution_zbh1_order")
    out = capsys.readouterr().out
    assert "input 'm = 2p + 1'" in out and "micro-batches held at once" in out, out
    assert "at most 4, 1F1B's peak" in out and "got 5" in out, out


@pytest.mark.slow
def test_lists_that_wait_on_each_other_are_named_before_running(grading_world, as_notebook,
                                                                capsys):
    assert not _grade(DEADLOCK, grading_world, as_notebook)
    assert "wait on each other forever" in capsys.readouterr().out


@pytest.mark.slow
def test_a_w_before_its_b_is_a_form_error(grading_world, as_notebook, capsys):
    assert not _grade(W_BEFORE_B, grading_world, as_notebook)
    assert "comes before ('B'" in capsys.readouterr().out
