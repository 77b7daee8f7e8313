"""Lab 01's write-the-code exercise (the learner's rank-group generator), graded on the shared
4-rank grading world (t=2, p=1, d=2): a right answer passes, plausible wrong ones fail with the
rank, the input, what was expected and what came back, and the unanswered stub says so.

The solution below is written by hand from the coordinates (it does not call mpu_lab); the
expected groups quoted in the assertions are the MPU walkthrough's and hand-worked ones."""
from mpu_lab.labkit import grader
from mpu_lab.labkit.rank_groups.exercises import RANK_GROUPS
from mpu_lab.labkit.notebooks.solutions import solution_source

# The lab's solution, as labs/solutions/ holds it (the learner loads it with %load): it must pass
# under its own name, and the verdict must name it, not the learner's function.
OWN_SOLUTION = solution_source("01")

# A right answer as a learner writes it (the wrong answers below are edits of it).
SOLUTION = '''
def my_groups(world_size, tp, pp, family):
    dp = world_size // (tp * pp)
    groups = {}
    for r in range(world_size):
        t, d, p = r % tp, (r // tp) % dp, r // (tp * dp)
        key = {"tp": (d, p), "dp": (t, p), "pp": (t, d)}[family]
        groups.setdefault(key, []).append(r)
    return list(groups.values())
'''

# t and p swapped: the job is read as t=p_given, p=t_given.
SWAPPED = '''
def my_groups(world_size, tp, pp, family):
    tp, pp = pp, tp
    dp = world_size // (tp * pp)
    groups = {}
    for r in range(world_size):
        t, d, p = r % tp, (r // tp) % dp, r // (tp * dp)
        key = {"tp": (d, p), "dp": (t, p), "pp": (t, d)}[family]
        groups.setdefault(key, []).append(r)
    return list(groups.values())
'''

# Every family cut into runs of neighbouring ranks (right for tp only).
CONSECUTIVE = '''
def my_groups(world_size, tp, pp, family):
    size = {"tp": tp, "pp": pp, "dp": world_size // (tp * pp)}[family]
    return [list(range(s, s + size)) for s in range(0, world_size, size)]
'''

STUB = '''
def my_groups(world_size, tp, pp, family):
    raise NotImplementedError("compute the groups from the ranks' coordinates")
'''

ASKS_MPU_LAB = '''
def my_groups(world_size, tp, pp, family):
    return parallel_state.generate_rank_groups(world_size, tp, pp)[family]
'''


def test_the_solution_passes_every_case_on_every_rank(grading_world, as_notebook, capsys):
    assert grader.grade(as_notebook(OWN_SOLUTION)["solution_groups"], RANK_GROUPS,
                           grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: solution_groups agrees with the reference on all 4 ranks for 8 "
                          "inputs")
    assert "16 GPUs, t=2, p=4" in out and "checked against its live process groups" in out


def test_the_solution_matches_the_walkthroughs_tables(as_notebook):
    """The solution itself, against the MPU walkthrough's printed lists (n=16, t=2, p=4)."""
    my_groups = as_notebook(OWN_SOLUTION)["solution_groups"]
    assert my_groups(16, 2, 4, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11],
                                         [12, 14], [13, 15]]
    assert my_groups(16, 2, 4, "pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14],
                                         [3, 7, 11, 15]]
    assert my_groups(16, 4, 2, "tp")[1] == [4, 5, 6, 7]


def test_swapped_sizes_fail_naming_rank_input_expected_and_got(grading_world, as_notebook, capsys):
    assert not grader.grade(as_notebook(SWAPPED)["my_groups"], RANK_GROUPS, grading_world)
    out = capsys.readouterr().out
    # the live world is n=4, t=2, p=1: read as t=1, rank 0's tensor-parallel group is [0] alone
    assert out.startswith("Not yet: rank 0, input 'the lab's world (its n, t, p), checked "
                          "against its live process groups': the tp group of rank 0 "
                          "(this world: n=4, t=2, p=1) expected [0, 1], got [0].")
    assert "Hint: in Megatron-core's default order tp-cp-ep-dp-pp" in out


def test_consecutive_data_parallel_groups_fail_on_the_rank_that_sees_it(grading_world,
                                                                         as_notebook, capsys):
    assert not grader.grade(as_notebook(CONSECUTIVE)["my_groups"], RANK_GROUPS, grading_world)
    out = capsys.readouterr().out
    # dp groups step by t=2: rank 0's is [0, 2], not its neighbours [0, 1]
    assert out.startswith("Not yet: rank 0, input 'the lab's world (its n, t, p), checked "
                          "against its live process groups': the dp group of rank 0 "
                          "(this world: n=4, t=2, p=1) expected [0, 2], got [0, 1].")


def test_a_wrong_answer_on_a_static_case_names_the_gpu_and_the_case(grading_world,
                                                                       as_notebook, capsys):
    """Right for the live world (p=1: pipeline groups of one rank) but with the pipeline groups
    as runs of neighbours: in the walkthrough's 16-GPU job GPU 0's pipeline group is
    [0, 4, 8, 12]. Rank r checks GPUs r, r+4, r+8, r+12 of the 16, so rank 0 reports GPU 0."""
    source = SOLUTION.replace("return list(groups.values())",
                              "if family == 'pp':\n        return [list(range(s, s + pp)) for s in "
                              "range(0, world_size, pp)]\n    return list(groups.values())")
    assert not grader.grade(as_notebook(source)["my_groups"], RANK_GROUPS, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 0, input '16 GPUs, t=2, p=4 (the MPU walkthrough's "
                          "first table)': the pp group of GPU 0 (n=16, t=2, p=4) expected "
                          "[0, 4, 8, 12], got [0, 1, 2, 3].")


def test_a_missing_group_is_reported_by_the_first_rank_left_out(grading_world, as_notebook,
                                                                 capsys):
    """The last group of every family dropped: in the live world (t=2, d=2) rank 0's groups
    are all there, rank 1's data-parallel group [1, 3] is the first one missing."""
    source = SOLUTION.replace("return list(groups.values())", "return list(groups.values())[:-1]")
    assert not grader.grade(as_notebook(source)["my_groups"], RANK_GROUPS, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 1, input 'the lab's world (its n, t, p), checked "
                          "against its live process groups': the dp group of rank 1 "
                          "(this world: n=4, t=2, p=1) expected [1, 3], got 1 in 0 groups.")


def test_calling_mpu_lab_for_the_groups_is_not_an_answer(grading_world, as_notebook, capsys):
    assert not grader.grade(as_notebook(ASKS_MPU_LAB)["my_groups"], RANK_GROUPS, grading_world)
    assert "got a call to generate_rank_groups" in capsys.readouterr().out


def test_the_stub_says_no_answer_yet(grading_world, as_notebook, capsys):
    assert not grader.grade(as_notebook(STUB)["my_groups"], RANK_GROUPS, grading_world)
    assert capsys.readouterr().out.startswith("No answer yet: my_groups still raises "
                                              "NotImplementedError")


# --------------------------------------------------------------------------- the lab's widget
def test_the_widget_saves_a_one_line_note_not_its_repr(monkeypatch, capsys):
    """Lab 01's slider cell: what a notebook stores (text/plain, once the widget view is
    dropped) is the note, not 'interactive(children=(IntSlider(...'; the view itself is still
    displayed for a live front end, and the cell has no Out[] value."""
    import json
    import pathlib

    import IPython.display

    from mpu_lab.labkit.rank_groups import viz
    from mpu_lab.labkit.rank_groups.viz import WIDGET_HINT
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: shown.append((a, k)))
    assert viz.interactive_rank_groups(world_size=8, tp=2, pp=2) is None
    (bundle,) = [a[0] for a, k in shown if k.get("raw")]
    assert bundle["text/plain"] == WIDGET_HINT
    assert "model_id" in bundle["application/vnd.jupyter.widget-view+json"]
    assert "n = 8 = t*p*c*d = 2*2*1*2" in capsys.readouterr().out    # drawn once, at the start
    lab = pathlib.Path(__file__).resolve().parents[3] / "labs" / "01_rank_groups.ipynb"
    (cell,) = [c for c in json.loads(lab.read_text())["cells"]
               if "viz.interactive_rank_groups(" in "".join(c["source"])]
    assert ["".join(o["data"]["text/plain"]) for o in cell["outputs"]] == [WIDGET_HINT]


def test_the_job_table_has_one_row_per_rank_in_100_characters():
    """Lab 01's torchrun job as a table: rank 5 of t = 2, p = 2 on 8 ranks (d = 2), worked by
    hand: tp_rank 1, dp_rank 0, pp_rank 1; tp [4, 5] (sum 9), dp [5, 7] (12), pp [1, 5] (6)."""
    from mpu_lab.labkit.rank_groups.viz import format_job_ranks
    res = {"rank": 5, "tp_rank": 1, "dp_rank": 0, "pp_rank": 1,
           "groups": {"tp": [4, 5], "dp": [5, 7], "pp": [1, 5]},
           "sums": {"tp": 9, "dp": 12, "pp": 6}}
    header, row = format_job_ranks([res]).splitlines()
    assert header.split()[:4] == ["rank", "tp_rank", "dp_rank", "pp_rank"]
    assert row.split() == ["5", "1", "0", "1", "[4,", "5]", "[5,", "7]", "[1,", "5]", "9", "12", "6"]
    assert max(len(header), len(row)) <= 100
