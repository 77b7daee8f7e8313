"""Lab 07's write-the-code exercise (the row-parallel forward), graded on the shared 4-rank
grading world (tp = 2, dp = 2): a right answer passes, the classic slips fail with the rank, the
input, expected and got, and the unanswered stub says so.

The expected outputs come from mpu_lab's RowParallelLinear (held against the dense layer by the
tensor-parallel tests); here the cases' tensors are also checked against the dense X A + b,
worked out on the CPU in this process."""
import torch

from mpu_lab.labkit.grader import grade
from mpu_lab.labkit.row_parallel import exercises as row_parallel
from mpu_lab.labkit.notebooks.solutions import solution_source

# The lab's solution, as labs/solutions/ holds it (the learner loads it with %load): it must pass
# under its own name, and the verdict must name it, not the learner's function.
OWN_SOLUTION = solution_source("07")

SOLUTION = '''
def my_row_forward(x, weight, bias, input_is_parallel):
    x_i = x if input_is_parallel else scatter_to_tensor_model_parallel_region(x)
    partial = x_i @ weight.t()
    y = reduce_from_tensor_model_parallel_region(partial)
    return y if bias is None else y + bias
'''

# The same, with dist.all_reduce on the tensor-parallel group (the autograd graph sees the sum
# as the identity, which is exactly g's backward).
SOLUTION_ALL_REDUCE = '''
def my_row_forward(x, weight, bias, input_is_parallel):
    t = parallel_state.get_tensor_model_parallel_world_size()
    if not input_is_parallel:
        x = scatter_to_tensor_model_parallel_region(x)
    y = x @ weight.t()
    dist.all_reduce(y, group=parallel_state.get_tensor_model_parallel_group())
    return y if bias is None else y + bias
'''

BIAS_BEFORE_REDUCE = '''
def my_row_forward(x, weight, bias, input_is_parallel):
    x_i = x if input_is_parallel else scatter_to_tensor_model_parallel_region(x)
    partial = x_i @ weight.t()
    if bias is not None:
        partial = partial + bias
    return reduce_from_tensor_model_parallel_region(partial)
'''

NO_REDUCE = '''
def my_row_forward(x, weight, bias, input_is_parallel):
    x_i = x if input_is_parallel else scatter_to_tensor_model_parallel_region(x)
    y = x_i @ weight.t()
    return y if bias is None else y + bias
'''

WORLD_REDUCE = '''
def my_row_forward(x, weight, bias, input_is_parallel):
    x_i = x if input_is_parallel else scatter_to_tensor_model_parallel_region(x)
    y = x_i @ weight.t()
    dist.all_reduce(y)
    return y if bias is None else y + bias
'''

# Splits X by hand: the forward is right, but each rank's x.grad holds only its own block.
CHUNK_BY_HAND = '''
def my_row_forward(x, weight, bias, input_is_parallel):
    if not input_is_parallel:
        t = parallel_state.get_tensor_model_parallel_world_size()
        x = x.chunk(t, dim=-1)[parallel_state.get_tensor_model_parallel_rank()]
    y = reduce_from_tensor_model_parallel_region(x @ weight.t())
    return y if bias is None else y + bias
'''

STUB = '''
def my_row_forward(x, weight, bias, input_is_parallel):
    raise NotImplementedError("split x, multiply by the shard, all-reduce over the group, add the bias")
'''


def _verdict(capsys, as_notebook, source, world):
    ok = grade(as_notebook(source)["my_row_forward"], row_parallel.ROW_FORWARD, world)
    return bool(ok), capsys.readouterr().out


def test_the_cases_are_the_dense_layer_cut_by_rows():
    """Independent of RowParallelLinear: the sum over t of X_i A_i, plus b, is X A + b on the
    cases' own tensors, and the first cases use the lab's sizes."""
    case = row_parallel.ROW_FORWARD.cases[0]
    assert case.params["input_size"] == 1024 and case.params["output_size"] == 512
    tp = 2
    master, bias, x, _ = row_parallel.row_inputs(case.params, tp, 0, 0)
    dense = x @ master.t() + bias
    blocks = zip(x.chunk(tp, dim=-1), master.chunk(tp, dim=1))
    by_rows = sum(x_i @ a_i.t() for x_i, a_i in blocks) + bias
    assert torch.allclose(by_rows, dense, atol=1e-5)
    assert bias.abs().min() > 0.1        # a bias added t times cannot hide
    other_replica = row_parallel.row_inputs(case.params, tp, 0, 1)[2]
    assert not torch.equal(x, other_replica)   # each data-parallel replica has its own X


def test_solution_is_right(grading_world, capsys, as_notebook):
    ok = grade(as_notebook(OWN_SOLUTION)["solution_row_forward"], row_parallel.ROW_FORWARD,
               grading_world)
    out = capsys.readouterr().out
    assert ok, out
    assert out.startswith("Right: solution_row_forward agrees")
    assert "all 4 ranks for 5 inputs" in out


def test_a_right_answer_under_the_learners_name_is_right(grading_world, capsys, as_notebook):
    ok, out = _verdict(capsys, as_notebook, SOLUTION, grading_world)
    assert ok, out
    assert out.startswith("Right: my_row_forward(x, weight, bias, input_is_parallel) agrees")


def test_all_reduce_on_the_tp_group_is_right_too(grading_world, capsys, as_notebook):
    ok, out = _verdict(capsys, as_notebook, SOLUTION_ALL_REDUCE, grading_world)
    assert ok, out


def test_bias_before_the_all_reduce_is_counted_t_times(grading_world, capsys, as_notebook):
    ok, out = _verdict(capsys, as_notebook, BIAS_BEFORE_REDUCE, grading_world)
    assert not ok
    assert out.startswith("Not yet: rank 0, input 'input_is_parallel=False")
    assert "expected shape (4, 512) [" in out and ", got shape (4, 512) [" in out
    assert "holds the bias 2 times" in out and "Hint:" in out


def test_forgetting_the_all_reduce_fails(grading_world, capsys, as_notebook):
    ok, out = _verdict(capsys, as_notebook, NO_REDUCE, grading_world)
    assert not ok
    assert out.startswith("Not yet: rank 0, input '") and "expected shape" in out and "got" in out
    assert "this rank's partial sum" in out


def test_reducing_over_the_world_fails_when_dp_is_2(grading_world, capsys, as_notebook):
    assert grading_world.world_size == 2 * grading_world.tp      # dp = 2
    ok, out = _verdict(capsys, as_notebook, WORLD_REDUCE, grading_world)
    assert not ok
    assert out.startswith("Not yet: rank 0, input '") and "expected shape" in out and "got" in out
    assert "not over the tensor-parallel group" in out


def test_splitting_by_hand_fails_on_the_input_gradient(grading_world, capsys, as_notebook):
    ok, out = _verdict(capsys, as_notebook, CHUNK_BY_HAND, grading_world)
    assert not ok
    assert out.startswith("Not yet: rank 0, input 'input_is_parallel=False")
    assert "x.grad (the input gradient) (right in this rank's block of columns, block 0, zero in " \
           "the others: the split's backward must all-gather the gradient) expected shape " \
           "(4, 1024)" in out


def test_stub_says_no_answer_yet(grading_world, capsys, as_notebook):
    ok, out = _verdict(capsys, as_notebook, STUB, grading_world)
    assert not ok
    assert out.startswith("No answer yet:")


def test_the_options_table_is_read_line_by_line_from_the_counted_collectives():
    from mpu_lab.labkit.row_parallel import lessons
    # rank 0's cases as launch/linear_options.py reports them (names from its `cases`)
    cases = [dict(layer="row", name="input_is_parallel=False", forward={"all_reduce": 1},
                  backward={"all_gather": 1}),
             dict(layer="row", name="skip_bias_add=True", forward={"all_reduce": 1}, backward={}),
             dict(layer="mlp", name="column(...) -> GeLU -> row(...)",
                  forward={"all_reduce": 1}, backward={"all_reduce": 1})]
    text = lessons.explain_row_options([{"cases": cases}])
    lines = text.split("\n- ")
    assert len(lines) == 4 and lines[0] == "Line by line:"
    assert "forward 1 all_reduce; backward 1 all_gather" in lines[1] and "full [b, in]" in lines[1]
    assert "backward none" in lines[2] and "[b, in/t]" in lines[2] and "bias" in lines[2]
    assert lines[3].startswith("mlp (forward 1 all_reduce; backward 1 all_reduce)")
    assert max(len(line) for line in text.splitlines()) <= 100


def test_the_operators_reading_gives_the_papers_all_reduces():
    """Shoeybi et al. 2019, §3, Fig. 3a: g all-reduces forward (identity backward), f all-reduces
    backward (identity forward), so the MLP all-reduces once each way; the reveal cell that
    prints it fits the notebook's 100 characters."""
    from mpu_lab.labkit.row_parallel.lessons import explain_mlp_operators
    text = explain_mlp_operators()
    flat = " ".join(text.split())
    assert "g (reduce_from_tensor_model_parallel_region) all-reduces them forward" in flat
    assert "f (copy_to_tensor_model_parallel_region), identity forward and all-reduce backward" in flat
    assert "once forward (g) and once backward (f)" in flat
    assert max(len(line) for line in text.splitlines()) <= 100
