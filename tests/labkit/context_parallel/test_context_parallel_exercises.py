"""Lab 10's write-the-code exercises, on the shared 4-rank grading world (every rank one CP
group: cp = 4).

* ``LSE_MERGE`` (the log-sum-exp merge, run inside a real ring on the world and compared with
  dense causal attention): the lab's solution passes; adding the two outputs, averaging them,
  and the textbook ``log(exp(a) + exp(b))`` fail, the last only on the input whose scores
  overflow fp32, each verdict naming the rank, the input and what differed; the stub has no
  answer yet.
* ``ZIGZAG_LAYOUT`` (this rank's chunks r and 2cp-1-r, compared with the mirror's
  ``get_batch_on_this_cp_rank``): the solution passes, and so does an index-based answer; a
  contiguous split and the two chunks in the wrong order fail naming the rank; the stub has no
  answer yet.
* The reference itself: the mirror's layout for s = 16, cp = 2 is Megatron's worked example
  (rank 0: positions 0-3 and 12-15, rank 1: 4-11), checked without any world.
"""
import pytest
import torch

from mpu_lab.core import context_parallel
from mpu_lab.labkit.context_parallel.exercises import LSE_MERGE, ZIGZAG_LAYOUT
from mpu_lab.labkit.grader import grade
from mpu_lab.labkit.context_parallel import exercises as cp_exercises
from mpu_lab.labkit.notebooks.solutions import solution_source

OWN_SOLUTION = solution_source("10")

MERGE_STUB = '''
def my_merge(out_a, lse_a, out_b, lse_b):
    raise NotImplementedError("merge them")
'''

SUM = '''
def my_merge(out_a, lse_a, out_b, lse_b):
    return out_a + out_b, torch.logaddexp(lse_a, lse_b)
'''

AVERAGE = '''
def my_merge(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)
'''

# right on paper, but exp(lse) overflows fp32 once the scores pass ~88
TEXTBOOK = '''
def my_merge(out_a, lse_a, out_b, lse_b):
    total = torch.exp(lse_a) + torch.exp(lse_b)
    lse = torch.log(total)
    w_a = (torch.exp(lse_a) / total).permute(2, 0, 1).unsqueeze(-1)
    w_b = (torch.exp(lse_b) / total).permute(2, 0, 1).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse
'''

ZIGZAG_STUB = '''
def my_zigzag(tokens, group):
    raise NotImplementedError("cut it")
'''

BY_INDEX = '''
def my_zigzag(tokens, group):
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    c = tokens.size(1) // (2 * cp)
    index = list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
    return tokens[:, index]
'''

CONTIGUOUS = '''
def my_zigzag(tokens, group):
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    return tokens.chunk(cp, dim=1)[r]
'''

SWAPPED = '''
def my_zigzag(tokens, group):
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    chunks = tokens.chunk(2 * cp, dim=1)
    return torch.cat([chunks[2 * cp - 1 - r], chunks[r]], dim=1)
'''


def _grade(source, name, exercise, world, as_notebook):
    return grade(as_notebook(source)[name], exercise, world)


def test_the_merge_solution_passes_on_every_rank(grading_world, as_notebook, capsys):
    assert grade(as_notebook(OWN_SOLUTION)["solution_merge"], LSE_MERGE, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: solution_merge agrees with the reference on all 4 ranks for "
                          "3 inputs: 1 sequence, 1 head, chunks of 1 token;"), out


@pytest.mark.parametrize("source", [SUM, AVERAGE], ids=["sum", "average"])
def test_a_merge_without_the_weights_names_the_rank_and_the_input(source, grading_world,
                                                                  as_notebook, capsys):
    assert not _grade(source, "my_merge", LSE_MERGE, grading_world, as_notebook)
    out = capsys.readouterr().out
    # rank 0's back-chunk queries meet a second block at step 1 (rank 0's first merge)
    assert out.startswith("Not yet: rank 0, input '1 sequence, 1 head, chunks of 1 token': CP "
                          "rank 0 of 4, positions [0, 7]: the attention output after the last "
                          "ring step expected shape (2, 1, 1, 4) ["), out
    assert "Hint: each block's output is already normalised" in out


def test_the_textbook_formula_overflows_on_large_scores(grading_world, as_notebook, capsys):
    assert not _grade(TEXTBOOK, "my_merge", LSE_MERGE, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank"), out
    # the first two inputs pass: the verdict names the third, whose exp(lse) overflows
    assert "input 'large scores: exp(score) overflows fp32'" in out, out


def test_the_merge_stub_has_no_answer_yet(grading_world, as_notebook, capsys):
    assert not _grade(MERGE_STUB, "my_merge", LSE_MERGE, grading_world, as_notebook)
    assert capsys.readouterr().out.startswith(
        "No answer yet: my_merge still raises NotImplementedError")


@pytest.mark.parametrize("name, source", [("solution_zigzag", OWN_SOLUTION),
                                          ("my_zigzag", BY_INDEX)], ids=["solution", "index"])
def test_the_layout_solutions_pass(name, source, grading_world, as_notebook, capsys):
    assert _grade(source, name, ZIGZAG_LAYOUT, grading_world, as_notebook)
    assert capsys.readouterr().out.startswith(f"Right: {name} agrees with the reference on all "
                                              f"4 ranks for 3 inputs"), name


@pytest.mark.parametrize("source, expected, got", [
    (CONTIGUOUS, "[0, 49]", "[0, 7]"),        # tokens 7*p: chunks 0 and 7 of 8
    (SWAPPED, "[0, 49]", "[49, 0]")], ids=["contiguous", "swapped"])
def test_a_wrong_layout_names_the_rank(source, expected, got, grading_world, as_notebook, capsys):
    assert not _grade(source, "my_zigzag", ZIGZAG_LAYOUT, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith(f"Not yet: rank 0, input '1 sequence, chunks of 1 token': CP rank 0 of "
                          f"4, s = 8: this rank's tokens expected shape (1, 2) {expected}, got "
                          f"shape (1, 2) {got}"), out


def test_the_layout_stub_has_no_answer_yet(grading_world, as_notebook, capsys):
    assert not _grade(ZIGZAG_STUB, "my_zigzag", ZIGZAG_LAYOUT, grading_world, as_notebook)
    assert capsys.readouterr().out.startswith("No answer yet: my_zigzag still raises")


def test_the_reference_layout_is_megatrons_worked_example():
    assert context_parallel.positions_on_rank(16, 0, 2) == [0, 1, 2, 3, 12, 13, 14, 15]
    assert context_parallel.positions_on_rank(16, 1, 2) == list(range(4, 12))
    tokens = cp_exercises.layout_input(1, 8, "tokens", seed=0)
    assert tokens.tolist() == [[0, 7, 14, 21, 28, 35, 42, 49]]
    assert torch.equal(cp_exercises.layout_input(2, 4, "floats", 3),
                       cp_exercises.layout_input(2, 4, "floats", 3))
