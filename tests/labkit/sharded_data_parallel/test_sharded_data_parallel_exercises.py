"""Lab 05's write-the-code exercise (an FSDP unit: ``my_fully_shard``, ``my_sharded_step``) on the
shared 4-rank grading world (tp = 2, so the data-parallel groups are [0, 2] and [1, 3]: d = 2).
The reference is a dense single-process model trained with SGD on the whole global batch.

The lab's solution passes under its own name; each typical mistake fails with the verdict that
names the missing step: no free after forward (the memory after forward), no gather before
backward (backward), an all-reduce instead of a reduce-scatter (the collectives), no average
(the gradient shard, d x the average), no free after backward (the memory after backward); the
stub has no answer yet."""
import pytest

from mpu_lab.labkit.grader import grade
from mpu_lab.labkit.notebooks.solutions import solution_source
from mpu_lab.labkit.sharded_data_parallel import exercises

pytestmark = pytest.mark.slow

OWN_SOLUTION = solution_source("05")
RIGHT = (OWN_SOLUTION.replace("solution_fully_shard", "my_fully_shard")
         .replace("solution_sharded_step", "my_sharded_step"))

STUB = '''
def my_fully_shard(unit):
    raise NotImplementedError("hooks")


def my_sharded_step(unit, lr):
    raise NotImplementedError("step")
'''

NO_FREE_AFTER_FORWARD = RIGHT.replace('''    def post_forward(module, args, output):
        reshard()
''', '''    def post_forward(module, args, output):
''')
NO_GATHER_FOR_BACKWARD = RIGHT.replace("            output.register_hook(lambda grad: unshard())",
                                       "            pass")
ALL_REDUCE = RIGHT.replace(
    "unit.shard_grad += comm.reduce_scatter(unit.flat_grads(), unit.group) / unit.d",
    "lo = unit.rank * unit.shard_numel\n"
    "            unit.shard_grad += (comm.all_reduce(unit.flat_grads(), unit.group)"
    " / unit.d)[lo:lo + unit.shard_numel]")
NO_AVERAGE = RIGHT.replace("unit.group) / unit.d", "unit.group)")
REDUCED = "unit.shard_grad += comm.reduce_scatter(unit.flat_grads(), unit.group) / unit.d"
NO_FREE_AFTER_BACKWARD = RIGHT.replace(f"{REDUCED}\n            reshard()", REDUCED)


def _grade(source, world, as_notebook):
    ns = as_notebook(source)
    return grade((ns["my_fully_shard"], ns["my_sharded_step"]), exercises.FSDP_UNIT, world)


def test_the_mistakes_are_made_from_the_solution():
    for wrong in (NO_FREE_AFTER_FORWARD, NO_GATHER_FOR_BACKWARD, ALL_REDUCE, NO_AVERAGE,
                  NO_FREE_AFTER_BACKWARD):
        assert wrong != RIGHT


def test_the_solution_passes_on_every_rank(grading_world, as_notebook, capsys):
    ns = as_notebook(OWN_SOLUTION)
    assert grade((ns["solution_fully_shard"], ns["solution_sharded_step"]), exercises.FSDP_UNIT,
                 grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: my_fully_shard, my_sharded_step (solution_fully_shard, "
                          "solution_sharded_step) agrees with the reference on all 4 ranks "
                          "for 3 inputs"), out


@pytest.mark.parametrize("source, verdict", [
    (NO_FREE_AFTER_FORWARD, "step 1, the memory after forward expected every unit's whole "
                            "parameters freed"),
    (NO_GATHER_FOR_BACKWARD, "step 1, backward expected each unit gathered again before its "
                             "backward"),
    (ALL_REDUCE, "the collectives issued (an all-reduce leaves every rank the whole gradient"),
    (NO_AVERAGE, "2 x the average (the sum over the 2 ranks)"),
    (NO_FREE_AFTER_BACKWARD, "step 1, the memory after backward expected every unit's whole "
                             "parameters freed once its gradients are reduce-scattered"),
], ids=["no free after forward", "no gather for backward", "all-reduce", "no average",
        "no free after backward"])
def test_each_mistake_names_the_missing_step(source, verdict, grading_world, as_notebook,
                                             capsys):
    assert not _grade(source, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 0, input 'one unit 4 -> 4, 1 step': data-parallel "
                          "rank 0 of 2:"), out
    assert verdict in out, out
    assert "Hint: before a unit's forward" in out


def test_the_stub_has_no_answer_yet(grading_world, as_notebook, capsys):
    assert not _grade(STUB, grading_world, as_notebook)
    assert capsys.readouterr().out.startswith("No answer yet: my_fully_shard still raises")
