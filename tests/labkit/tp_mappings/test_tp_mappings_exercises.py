"""Lab 08's write-the-code exercises (the forward and backward of f and g, Shoeybi et al. 2019
§3) on the shared 4-rank grading world (t=2, p=1, d=2: tensor-parallel groups [0, 1] and
[2, 3]), and the grader's own error paths, which no other test reaches: a stub, input that is
not a function, a rank that raises, a collective only some ranks enter (the world restarts and
the next grade passes), a world that needs a restart, a world too small, an exercise with its
own layout.

The solutions are written by hand with ``dist.all_reduce`` (they do not call mpu_lab's
mappings); the values in the assertions are worked by hand from the case inputs: case 1 is
x = [0, 1, 2, 3] + 10 * rank with a gradient of ones, so rank 0's group [0, 1] sums x to
[10, 12, 14, 16] and the whole world to [60, 64, 68, 72]."""
import linecache
import types

import pytest

from mpu_lab.labkit import grader
from mpu_lab.labkit.tp_mappings.exercises import F_AND_G_CASES, F_EXERCISE, G_EXERCISE, run_g_case
from mpu_lab.labkit.notebooks.solutions import solution_source

# The lab's solution, as labs/solutions/ holds it (the learner loads it with %load): it must pass
# under its own name, and the verdict must name it, not the learner's function.
OWN_SOLUTION = solution_source("08")

CASE_1 = "x = [0, 1, 2, 3] + 10 * rank, grad = ones"

F_SOLUTION = '''
def f_forward(x):
    return x

def f_backward(grad):
    dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
    return grad
'''

# g with the all-reduce into a new tensor (the lab's solution) ...
G_SOLUTION = '''
def g_forward(x):
    out = x.clone()
    dist.all_reduce(out, group=parallel_state.get_tensor_model_parallel_group())
    return out

def g_backward(grad):
    return grad
'''

# ... and in place on the input, as Megatron does: the grader gives it a copy of its own.
G_IN_PLACE = '''
def g_forward(x):
    dist.all_reduce(x, group=parallel_state.get_tensor_model_parallel_group())
    return x

def g_backward(grad):
    return grad
'''

# f's all-reduce on the wrong side: forward instead of backward (that is g).
F_REDUCES_FORWARD = '''
def f_forward(x):
    dist.all_reduce(x, group=parallel_state.get_tensor_model_parallel_group())
    return x

def f_backward(grad):
    return grad
'''

# the right side, but over every rank of the world (group=None): d=2 copies too many
F_WORLD_GROUP = '''
def f_forward(x):
    return x

def f_backward(grad):
    dist.all_reduce(grad)
    return grad
'''

G_WORLD_GROUP = '''
def g_forward(x):
    dist.all_reduce(x)
    return x

def g_backward(grad):
    return grad
'''

# g's all-reduce on both sides: the gradient is summed a second time
G_REDUCES_BOTH = '''
def g_forward(x):
    dist.all_reduce(x, group=parallel_state.get_tensor_model_parallel_group())
    return x

def g_backward(grad):
    dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
    return grad
'''

F_STUBS = '''
def f_forward(x):
    raise NotImplementedError("return f's output for x")

def f_backward(grad):
    raise NotImplementedError("return the gradient of x")
'''

F_BACKWARD_STUB = '''
def f_forward(x):
    return x

def f_backward(grad):
    raise NotImplementedError("return the gradient of x")
'''

# raises on ranks 2 and 3 only, before any collective of the learner's
F_RAISES = '''
def f_forward(x):
    scale = [1.0, 1.0][rank]
    return x * scale

def f_backward(grad):
    return grad
'''

# only rank 0 enters the all-reduce; its partner rank 1 never does
G_ONLY_RANK_0 = '''
def g_forward(x):
    if rank == 0:
        dist.all_reduce(x, group=parallel_state.get_tensor_model_parallel_group())
    return x

def g_backward(grad):
    return grad
'''

# rank 3 raises where its partner rank 2 waits in the all-reduce
F_RANK_3_RAISES = '''
def f_forward(x):
    return x

def f_backward(grad):
    if rank == 3:
        raise ValueError("rank 3 gives up")
    dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
    return grad
'''


def define(as_notebook, source, *names):
    """The named functions of ``source``, defined as a notebook cell defines them, and the cell's
    lines in linecache, where IPython keeps a cell's source (the grader quotes the line)."""
    linecache.cache["<learner cell>"] = (len(source), None, source.splitlines(True),
                                         "<learner cell>")
    namespace = as_notebook(source)
    return tuple(namespace[n] for n in names)


def f_of(as_notebook, source):
    return define(as_notebook, source, "f_forward", "f_backward")


def g_of(as_notebook, source):
    return define(as_notebook, source, "g_forward", "g_backward")


ALL_CASES = "; ".join(c.name for c in F_AND_G_CASES)


# --------------------------------------------------------------------------- right answers
def test_the_solution_files_f_and_g_pass_under_their_own_names(grading_world, as_notebook,
                                                                capsys):
    names = define(as_notebook, OWN_SOLUTION, "solution_f_forward", "solution_f_backward",
                   "solution_g_forward", "solution_g_backward")
    assert grader.grade(names[:2], F_EXERCISE, grading_world)
    assert grader.grade(names[2:], G_EXERCISE, grading_world)
    assert capsys.readouterr().out == (
        f"Right: f (solution_f_forward, solution_f_backward) agrees with the reference on all 4 "
        f"ranks for 4 inputs: {ALL_CASES}.\n"
        f"Right: g (solution_g_forward, solution_g_backward) agrees with the reference on all 4 "
        f"ranks for 4 inputs: {ALL_CASES}.\n")


def test_f_solution_passes_every_case_on_every_rank(grading_world, as_notebook, capsys):
    assert grader.grade(f_of(as_notebook, F_SOLUTION), F_EXERCISE, grading_world)
    assert capsys.readouterr().out == (
        f"Right: f (f_forward, f_backward) agrees with the reference on all 4 ranks for 4 "
        f"inputs: {ALL_CASES}.\n")


def test_g_solution_passes_out_of_place_and_in_place(grading_world, as_notebook, capsys):
    assert grader.grade(g_of(as_notebook, G_SOLUTION), G_EXERCISE, grading_world)
    assert grader.grade(g_of(as_notebook, G_IN_PLACE), G_EXERCISE, grading_world)
    out = capsys.readouterr().out
    assert out.count("Right: g (g_forward, g_backward) agrees with the reference on all 4 "
                     "ranks for 4 inputs") == 2


def test_the_cases_cover_a_vector_a_matrix_one_element_and_per_rank_gradients():
    names = [c.name for c in F_AND_G_CASES]
    assert [c.params["x"]["shape"] for c in F_AND_G_CASES] == [[4], [3, 2], [1], [3]]
    assert "one element" in names[2] and "(rank + 1)" in names[3]


# --------------------------------------------------------------------------- wrong answers
def test_f_reducing_in_forward_fails_on_rank_0_with_its_group_sum(grading_world, as_notebook,
                                                                   capsys):
    assert not grader.grade(f_of(as_notebook, F_REDUCES_FORWARD), F_EXERCISE, grading_world)
    out = capsys.readouterr().out
    assert out.startswith(
        f"Not yet: rank 0, input '{CASE_1}': forward (f_forward(x)) expected shape (4,) "
        f"[0, 1, 2, 3], got shape (4,) [10, 12, 14, 16].\nHint: f stands before a "
        f"column-parallel layer")


def test_f_reducing_over_the_world_fails_in_backward(grading_world, as_notebook, capsys):
    assert not grader.grade(f_of(as_notebook, F_WORLD_GROUP), F_EXERCISE, grading_world)
    out = capsys.readouterr().out
    # group [0, 1] sums two gradients of ones; the world sums four
    assert out.startswith(
        f"Not yet: rank 0, input '{CASE_1}': x.grad (f_backward(grad)) expected shape (4,) "
        f"[2, 2, 2, 2], got shape (4,) [4, 4, 4, 4].")


def test_g_reducing_over_the_world_fails_with_the_world_sum(grading_world, as_notebook, capsys):
    assert not grader.grade(g_of(as_notebook, G_WORLD_GROUP), G_EXERCISE, grading_world)
    out = capsys.readouterr().out
    assert out.startswith(
        f"Not yet: rank 0, input '{CASE_1}': forward (g_forward(x)) expected shape (4,) "
        f"[10, 12, 14, 16], got shape (4,) [60, 64, 68, 72].\nHint: g stands after a "
        f"row-parallel layer")


def test_g_reducing_in_backward_too_fails_on_the_gradient(grading_world, as_notebook, capsys):
    assert not grader.grade(g_of(as_notebook, G_REDUCES_BOTH), G_EXERCISE, grading_world)
    assert capsys.readouterr().out.startswith(
        f"Not yet: rank 0, input '{CASE_1}': x.grad (g_backward(grad)) expected shape (4,) "
        f"[1, 1, 1, 1], got shape (4,) [2, 2, 2, 2].")


def test_f_written_as_g_fails_the_f_exercise(grading_world, as_notebook, capsys):
    """The solution of one exercise is a wrong answer to the other."""
    assert not grader.grade(g_of(as_notebook, G_SOLUTION), F_EXERCISE, grading_world)
    assert capsys.readouterr().out.startswith(f"Not yet: rank 0, input '{CASE_1}': forward")


# --------------------------------------------------------------------------- unanswered, not functions
def test_the_stubs_print_no_answer_yet(grading_world, as_notebook, capsys):
    assert not grader.grade(f_of(as_notebook, F_STUBS), F_EXERCISE, grading_world)
    assert capsys.readouterr().out == ("No answer yet: f_forward still raises "
                                       "NotImplementedError:\nwrite its body, then run this cell "
                                       "again.\n")


def test_a_stub_left_in_backward_is_named(grading_world, as_notebook, capsys):
    """The backward's stub raises inside autograd's engine; the verdict still names it."""
    assert not grader.grade(f_of(as_notebook, F_BACKWARD_STUB), F_EXERCISE, grading_world)
    assert capsys.readouterr().out.startswith("No answer yet: f_backward still raises")


def test_what_is_not_a_pair_of_functions_is_refused_before_any_rank_runs(as_notebook, capsys):
    f_forward, _ = f_of(as_notebook, F_SOLUTION)
    offline = types.SimpleNamespace(running=False)   # never reached: refused before
    assert not grader.grade(None, F_EXERCISE, offline)
    assert not grader.grade((f_forward, None), F_EXERCISE, offline)
    assert not grader.grade(f_forward, F_EXERCISE, offline)
    assert not grader.grade((f_forward, 3), F_EXERCISE, offline)
    assert capsys.readouterr().out.splitlines() == [
        "No answer yet: write f_forward, f_backward in the cell above, then run this cell again.",
        "No answer yet: write f_backward in the cell above, then run this cell again.",
        "Not yet: pass the 2 functions as a tuple (f_forward, f_backward), got function.",
        "Not yet: f_backward is not a function (got int): pass the functions f_forward, "
        "f_backward, in that order.",
    ]


def test_a_single_function_exercise_refuses_none_and_non_functions(capsys):
    one = grader.Exercise("my_fn", run_g_case, F_AND_G_CASES, "a hint")
    offline = types.SimpleNamespace(running=False)
    assert not grader.grade(None, one, offline)
    assert not grader.grade([1, 2], one, offline)
    assert capsys.readouterr().out.splitlines() == [
        "No answer yet: write my_fn in the cell above, then run this cell again.",
        "Not yet: my_fn must be a function, got list."]


def test_a_stopped_world_or_one_too_small_is_named(grading_world, as_notebook, capsys):
    pair = f_of(as_notebook, F_SOLUTION)
    assert not grader.grade(pair, F_EXERCISE, types.SimpleNamespace(running=False))
    needs_8 = grader.Exercise(
        "f", F_EXERCISE.run_case, F_AND_G_CASES, "a hint", parts=F_EXERCISE.parts,
        ranks_needed=lambda n, tp, pp: None if n >= 8 else f"it needs 8 ranks, this world has {n}")
    assert not grader.grade(pair, needs_8, grading_world)
    assert capsys.readouterr().out.splitlines() == [
        "Not yet: this world is stopped: start one with playground.start_world(...) and grade "
        "on it.",
        "Not yet: this world cannot grade f: it needs 8 ranks, this world has 4"]


# --------------------------------------------------------------------------- errors on the ranks
def test_a_rank_that_raises_is_named_with_its_error_and_line(grading_world, as_notebook, capsys):
    assert not grader.grade(f_of(as_notebook, F_RAISES), F_EXERCISE, grading_world)
    out = capsys.readouterr().out
    # ranks 0 and 1 index [1.0, 1.0] fine; rank 2 is the first that raises
    assert out.startswith(f"Not yet: on input '{CASE_1}' rank 2 raised IndexError: list index "
                          f"out of range\n  in f_forward: scale = [1.0, 1.0][rank]\n")
    assert 'File "<learner cell>", line 3, in f_forward' in out
    assert "Hint: f stands before" in out
    assert not grading_world.broken       # no collective was left waiting: no restart needed


def test_a_collective_only_rank_0_enters_times_out_restarts_and_the_next_grade_passes(
        grading_world, as_notebook, capsys):
    assert not grader.grade(g_of(as_notebook, G_ONLY_RANK_0), G_EXERCISE, grading_world)
    out = capsys.readouterr().out
    assert out.startswith(
        f"Not yet: on input '{CASE_1}' rank 0 waited 4 s in a collective that ranks [1, 2, 3] "
        f"never entered (ranks [1, 2, 3] finished input '{CASE_1}' without it): every rank of "
        f"a group must make the same collective calls, on the same group, in the same order. "
        f"(The world was restarted.)\nHint: g stands after")
    assert grading_world.running and not grading_world.broken
    assert grader.grade(g_of(as_notebook, G_SOLUTION), G_EXERCISE, grading_world)
    assert capsys.readouterr().out.startswith("Right: g (g_forward, g_backward)")


def test_a_rank_that_raises_before_its_partners_collective_is_named(grading_world, as_notebook,
                                                                     capsys):
    assert not grader.grade(f_of(as_notebook, F_RANK_3_RAISES), F_EXERCISE, grading_world)
    out = capsys.readouterr().out
    assert out.startswith(
        f"Not yet: on input '{CASE_1}' rank 2 waited 4 s in a collective that ranks [0, 1, 3] "
        f"never entered (ranks [0, 1] finished input '{CASE_1}' without it; rank 3 raised "
        f"ValueError: rank 3 gives up (in f_backward: raise ValueError(\"rank 3 gives up\"))): "
        f"every rank of a group")
    assert grading_world.running and not grading_world.broken


def test_a_world_left_broken_is_restarted_before_grading(grading_world, as_notebook, capsys):
    grading_world.broken = "a collective timed out on ranks [0] (set by this test)"
    assert grader.grade(f_of(as_notebook, F_SOLUTION), F_EXERCISE, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("(the world needed a restart: a collective timed out on ranks [0] "
                          "(set by this test); restarted it first)\nRight: f (f_forward, "
                          "f_backward)")
    assert not grading_world.broken


# --------------------------------------------------------------------------- an exercise's own layout
def test_an_exercise_layout_regroups_for_the_grading_and_puts_the_worlds_groups_back(
        grading_world, as_notebook, capsys):
    """At t = 4 (the whole world one tensor-parallel group) an all-reduce over the world is g;
    afterwards the world is back at t = 2, where it is wrong again."""
    world_wide = g_of(as_notebook, G_WORLD_GROUP)
    g_at_4 = grader.Exercise("g at t=4", G_EXERCISE.run_case, F_AND_G_CASES[:1], "a hint",
                                parts=G_EXERCISE.parts, layout=lambda n: (n, 1))
    assert grader.grade(world_wide, g_at_4, grading_world)
    assert not grader.grade(world_wide, G_EXERCISE, grading_world)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"Right: g at t=4 agrees with the reference on all 4 ranks for 1 input: "
                      f"{CASE_1}.")
    assert out[1].startswith(f"Not yet: rank 0, input '{CASE_1}': forward (g_forward(x)) "
                             f"expected shape (4,) [10, 12, 14, 16], got shape (4,) [60, 64, 68, 72].")


def test_f_and_g_source_is_read_from_mappings_by_name(capsys):
    from mpu_lab.labkit.tp_mappings import exercises as tp_mappings
    from mpu_lab.core.tensor_parallel import mappings
    tp_mappings.print_f_and_g_source()
    out = capsys.readouterr().out
    names = ["def _reduce(", "class _CopyToModelParallelRegion(",
             "class _ReduceFromModelParallelRegion(", "def copy_to_tensor_model_parallel_region(",
             "def reduce_from_tensor_model_parallel_region("]
    assert [out.index(n) for n in names] == sorted(out.index(n) for n in names)
    assert "return _reduce(grad_output, ctx.group), None" in out      # f: all-reduce backward
    assert "class _ScatterToModelParallelRegion" not in out
    with pytest.raises(ValueError, match=r"defines no \['f'\]"):
        tp_mappings.source_of(mappings, ["f"])


def test_the_side_by_side_table_keeps_the_worst_difference_over_ranks(capsys):
    from mpu_lab.labkit.tp_mappings import exercises as tp_mappings
    rank = lambda r, fwd: {"rank": r, "tp": 2, "megatron_core": "0.0", "groups_equal": True,
                           "mappings": {"copy": {"forward": fwd, "backward": 0.0,
                                                 "shape": [[8, 2, 16], [8, 2, 16]]}}}
    tp_mappings.print_side_by_side([rank(0, 0.0), rank(1, 2.5e-7)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("on each of 2 ranks;")
    assert lines[1] == "rank groups the same on every rank: True"
    assert max(map(len, lines)) <= 100
    assert lines[3].split() == ["copy_to_tensor_model_parallel_region", "[8,", "2,", "16]", "->",
                                "[8,", "2,", "16]", "2.5e-07", "/", "0"]
    tp_mappings.print_side_by_side([{"skipped": "megatron-core is not installed"}])
    assert capsys.readouterr().out == "megatron-core is not installed\n"
