"""Lab 07's build on the shared 4-rank grading world (regrouped to tp = 2, pp = 1, so d = 2): the
learner's whole ``RowParallelLinear``, a class typed in a notebook cell (its text in linecache,
as IPython keeps it) and sent to the ranks as its source.

* A right class (the learner's own and the lab's solution) passes and is saved into the
  learner's package as ``my_megatron/layers.py:RowParallelLinear``.
* Each typical mistake fails with the verdict that names it: the weight cut along the output
  (dim 0), a missing g (this rank's partial sum), the bias added before g (t times), the whole
  sum kept under sequence parallelism (no reduce-scatter), a plain slice of the input (its
  backward fills only this rank's block of dL/dX), the bias added under skip_bias_add. The
  references: the mirror's layer from the same seed (tested against its dense twin in
  tests/tensor_parallel) and the collectives worked out by hand in the build's module.
* The stub has no answer yet.
* Both labs' solution classes, saved by their graders into one package, train the capstone's
  GPT at TP = 2 equal to the mirror's (launch/capstone.py through the layer spec: the signature
  and the ``(output, bias)`` convention the capstone needs).
"""

import pytest

from mpu_lab.labkit.capstone import run_capstone
from mpu_lab.labkit.column_parallel import build as column_build
from mpu_lab.labkit.grader import grade
from mpu_lab.labkit.notebooks.solutions import solution_source
from mpu_lab.labkit.row_parallel import build
from learner_cells import import_file, run_cell

# A right answer as a learner may write it (not the lab's solution: torch.split, matmul).
ROW = '''
class MyRowParallelLinear(torch.nn.Module):
    def __init__(self, input_size, output_size, bias=True, input_is_parallel=False,
                 init_method=torch.nn.init.xavier_normal_, skip_bias_add=False,
                 sequence_parallel=False, params_dtype=torch.float32, **unused):
        super().__init__()
        from mpu_lab.core.utils import get_device
        t = parallel_state.get_tensor_model_parallel_world_size()
        r = parallel_state.get_tensor_model_parallel_rank()
        master = torch.empty(output_size, input_size)
        init_method(master)
        cols = torch.split(master, input_size // t, dim=1)[r]
        self.weight = torch.nn.Parameter(cols.clone().to(get_device(), params_dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, device=get_device()))
        else:
            self.register_parameter("bias", None)
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x)
        y = torch.matmul(x, self.weight.t())
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y)
        else:
            y = reduce_from_tensor_model_parallel_region(y)
        if self.bias is not None and not self.skip_bias_add:
            y = y + self.bias
        return y, self.bias if self.skip_bias_add else None
'''

STUB = '''
class MyRowParallelLinear(torch.nn.Module):
    def __init__(self, input_size, output_size, bias=True, input_is_parallel=False,
                 init_method=torch.nn.init.xavier_normal_, skip_bias_add=False,
                 sequence_parallel=False, params_dtype=torch.float32, **unused):
        super().__init__()
        raise NotImplementedError("write __init__")

    def forward(self, x):
        raise NotImplementedError("write forward")
'''

MISTAKES = {
    "cut along dim 0": ("cols = torch.split(master, input_size // t, dim=1)[r]",
                        "cols = torch.split(master, output_size // t, dim=0)[r]"),
    "no g": ("            y = reduce_from_tensor_model_parallel_region(y)\n",
             "            pass\n"),
    "bias before g": ("        y = torch.matmul(x, self.weight.t())\n        if self.seq",
                      "        y = torch.matmul(x, self.weight.t())\n"
                      "        if self.bias is not None and not self.skip_bias_add:\n"
                      "            y = y + self.bias\n"
                      "        if self.seq"),
    "no reduce-scatter": ("            y = reduce_scatter_to_sequence_parallel_region(y)\n",
                          "            y = reduce_from_tensor_model_parallel_region(y)\n"),
    "a plain slice": ("            x = scatter_to_tensor_model_parallel_region(x)\n",
                      "            n = x.shape[-1] // parallel_state."
                      "get_tensor_model_parallel_world_size()\n"
                      "            r = parallel_state.get_tensor_model_parallel_rank()\n"
                      "            x = x[..., r * n:(r + 1) * n]\n"),
    "bias under skip_bias_add": ("if self.bias is not None and not self.skip_bias_add:",
                                 "if self.bias is not None:"),
}
CASES = [c.name for c in build.ROW_CASES]
VERDICTS = {
    "cut along dim 0": (CASES[0], "weight's shape expected (6, 4), this rank's block of W = A^T "
                                  "(6, 8) cut along dim 1, got (3, 8): cut along dim 0, the "
                                  "output: that is the column-parallel cut"),
    "no g": (CASES[0], "this rank's partial sum X_i A_i: g's all-reduce over the "
                       "tensor-parallel group is missing"),
    "bias before g": (CASES[0], "the bias 2 times: it was added before g's all-reduce"),
    "no reduce-scatter": (CASES[3], "the output expected shape (2, 2, 6), got shape (4, 2, 6): "
                                    "the whole sum on every rank: with sequence_parallel g is "
                                    "a reduce-scatter"),
    "a plain slice": (CASES[0], "only this rank's block of dL/dX is filled: the split of the "
                                "input must all-gather the gradient's blocks in backward"),
    "bias under skip_bias_add": (CASES[2], "the bias was added: with skip_bias_add the layer "
                                           "returns it"),
}


def _cell(source, name, key):
    """``source`` as the learner's cell (with its own ``import torch``): the class ``name``."""
    return run_cell("import torch\n" + source, f"row-{key}")[name]


def _mistake(name):
    old, new = MISTAKES[name]
    assert ROW.count(old) == 1, name
    wrong = ROW.replace(old, new)
    if name == "bias before g":               # moved, not added twice: drop the add after g
        after = "        if self.bias is not None and not self.skip_bias_add:\n            " \
                "y = y + self.bias\n        return"
        assert wrong.count(after) == 1
        wrong = wrong.replace(after, "        return")
    return wrong


def test_the_learners_class_passes_and_is_saved(grading_world, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(tmp_path / "my_megatron"))
    assert grade(_cell(ROW, "MyRowParallelLinear", "right"), build.ROW_PARALLEL_LINEAR,
                 grading_world)
    out = capsys.readouterr().out
    assert out.startswith(f"Right: MyRowParallelLinear agrees with the reference on all 4 "
                          f"ranks for 5 inputs: {CASES[0]};"), out
    assert "saved: my_megatron/layers.py (RowParallelLinear)" in out
    assert isinstance(import_file(tmp_path / "my_megatron" / "layers.py").RowParallelLinear, type)


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_fails_naming_it(mistake, grading_world, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(tmp_path / "my_megatron"))
    learner = _cell(_mistake(mistake), "MyRowParallelLinear", mistake.replace(" ", "-"))
    assert not grade(learner, build.ROW_PARALLEL_LINEAR, grading_world)
    out = capsys.readouterr().out
    case, said = VERDICTS[mistake]
    assert out.startswith(f"Not yet: rank 0, input '{case}': "), out
    assert said in out, out
    assert "Hint: __init__: draw the whole master weight" in out
    assert "saved:" not in out and not (tmp_path / "my_megatron").exists()


def test_the_stub_has_no_answer_yet(grading_world, capsys):
    assert not grade(_cell(STUB, "MyRowParallelLinear", "stub"), build.ROW_PARALLEL_LINEAR,
                     grading_world)
    assert capsys.readouterr().out.startswith("No answer yet: MyRowParallelLinear still raises "
                                              "NotImplementedError")


def test_both_solutions_saved_by_their_graders_train_the_capstones_gpt(grading_world, capsys,
                                                                      monkeypatch, tmp_path):
    package = tmp_path / "my_megatron"
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(package))
    column = _cell(solution_source("06"), "SolutionColumnParallelLinear", "solution-06")
    row = _cell(solution_source("07"), "SolutionRowParallelLinear", "solution-07")
    assert grade(column, column_build.COLUMN_PARALLEL_LINEAR, grading_world)
    assert grade(row, build.ROW_PARALLEL_LINEAR, grading_world)
    out = capsys.readouterr().out
    assert out.count("saved: my_megatron/layers.py") == 2, out
    assert out.splitlines()[-2].startswith("Right: SolutionRowParallelLinear agrees"), out
    result = run_capstone(package, 2, 1, train_iters=2, echo=False)
    assert result.exit_code == 0, result.lines
    assert "used: layers.py:ColumnParallelLinear x4" in result.lines      # 2 per layer, 2 layers
    assert "used: layers.py:RowParallelLinear x4" in result.lines
    assert result.lines[-1] == "capstone: losses equal the mirror's within 1e-05 over 2 iterations"
