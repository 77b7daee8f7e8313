"""Lab 06's build on the shared 4-rank grading world (the build regroups it to tp = 2, pp = 1,
so d = 2): the learner's whole ``ColumnParallelLinear``, a class typed in a notebook cell (its
text in linecache, as IPython keeps it) and sent to the ranks as its source.

* A right class (the learner's own and the lab's solution) passes and is saved into the
  learner's package as ``my_megatron/layers.py:ColumnParallelLinear``, a module Python imports.
* Each typical mistake fails with the verdict that names it: the weight cut along the input
  (dim 1), another rank's block, a missing f (x.grad is this rank's term only), a gather not
  asked for, the bias added under skip_bias_add, the sequence-parallel all-gather left out, and
  a right answer that communicates more than it needs (an extra all-gather). The references: the
  mirror's layer from the same seed (tested against its dense twin in tests/tensor_parallel) and
  the collectives worked out by hand in the build's module.
* The stub has no answer yet.
"""

import pytest

from mpu_lab.labkit.column_parallel import build
from mpu_lab.labkit.grader import grade
from mpu_lab.labkit.notebooks.solutions import solution_source
from learner_cells import import_file, run_cell

# A right answer as a learner may write it (not the lab's solution: torch.split, matmul).
COLUMN = '''
class MyColumnParallelLinear(torch.nn.Module):
    def __init__(self, input_size, output_size, bias=True, gather_output=True,
                 init_method=torch.nn.init.xavier_normal_, skip_bias_add=False,
                 sequence_parallel=False, params_dtype=torch.float32, **unused):
        super().__init__()
        from mpu_lab.core.utils import get_device
        t = parallel_state.get_tensor_model_parallel_world_size()
        r = parallel_state.get_tensor_model_parallel_rank()
        master = torch.empty(output_size, input_size)
        init_method(master)
        rows = torch.split(master, output_size // t, dim=0)[r]
        self.weight = torch.nn.Parameter(rows.clone().to(get_device(), params_dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size // t, device=get_device()))
        else:
            self.register_parameter("bias", None)
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x)
        else:
            x = copy_to_tensor_model_parallel_region(x)
        y = torch.matmul(x, self.weight.t())
        if self.bias is not None and not self.skip_bias_add:
            y = y + self.bias
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y)
        return y, self.bias if self.skip_bias_add else None
'''

STUB = '''
class MyColumnParallelLinear(torch.nn.Module):
    def __init__(self, input_size, output_size, bias=True, gather_output=True,
                 init_method=torch.nn.init.xavier_normal_, skip_bias_add=False,
                 sequence_parallel=False, params_dtype=torch.float32, **unused):
        super().__init__()
        raise NotImplementedError("write __init__")

    def forward(self, x):
        raise NotImplementedError("write forward")
'''

# each mistake: (the line of COLUMN it changes, what it becomes)
MISTAKES = {
    "cut along dim 1": ("rows = torch.split(master, output_size // t, dim=0)[r]",
                        "rows = torch.split(master, input_size // t, dim=1)[r]"),
    "another rank's block": ("rows = torch.split(master, output_size // t, dim=0)[r]",
                             "rows = torch.split(master, output_size // t, dim=0)[1 - r]"),
    "no f": ("            x = copy_to_tensor_model_parallel_region(x)\n",
             "            pass\n"),
    "gathers always": ("        if self.gather_output:\n",
                       "        if True:\n"),
    "bias under skip_bias_add": ("if self.bias is not None and not self.skip_bias_add:",
                                 "if self.bias is not None:"),
    "no sequence gather": ("        if self.sequence_parallel:\n            x = "
                           "gather_from_sequence_parallel_region(x)\n        else:\n"
                           "            x = copy_to_tensor_model_parallel_region(x)\n",
                           "        x = copy_to_tensor_model_parallel_region(x)\n"),
    "an extra all-gather": ("        if self.gather_output:\n            y = "
                            "gather_from_tensor_model_parallel_region(y)\n",
                            "        y = gather_from_tensor_model_parallel_region(y)\n"
                            "        if not self.gather_output:\n"
                            "            y = scatter_to_tensor_model_parallel_region(y)\n"),
}
CASES = [c.name for c in build.COLUMN_CASES]
# mistake -> (the first case it fails, what the verdict says)
VERDICTS = {
    "cut along dim 1": (CASES[0], "weight's shape expected (3, 8), this rank's block of W = A^T "
                                  "(6, 8) cut along dim 0, got (6, 4): cut along dim 1, the "
                                  "input: that is the row-parallel cut"),
    "another rank's block": (CASES[0], "block 1 of the master, not block 0: this rank keeps the "
                                       "block of its tensor-parallel rank"),
    "no f": (CASES[0], "x.grad expected shape (4, 2, 8)"),
    "gathers always": (CASES[0], "the output expected shape (4, 2, 3), got shape (4, 2, 6): "
                                 "the gathered Y: with gather_output=False each rank keeps its "
                                 "block of columns"),
    "bias under skip_bias_add": (CASES[2], "the bias was added: with skip_bias_add the layer "
                                           "returns it and leaves the adding to the caller"),
    "no sequence gather": (CASES[3], "the output expected shape (4, 2, 3), got shape (2, 2, 3): "
                                     "this rank's block of the sequence"),
    "an extra all-gather": (CASES[0], "the collectives of forward expected none, got 1 "
                                      "all-gather"),
}


def _cell(source, name, key):
    """``source`` as the learner's cell (with its own ``import torch``): the class ``name``."""
    return run_cell("import torch\n" + source, f"column-{key}")[name]


def _mistake(name):
    old, new = MISTAKES[name]
    assert COLUMN.count(old) == 1, name
    return COLUMN.replace(old, new)


def test_the_learners_class_passes_and_is_saved(grading_world, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(tmp_path / "my_megatron"))
    assert grade(_cell(COLUMN, "MyColumnParallelLinear", "right"), build.COLUMN_PARALLEL_LINEAR,
                 grading_world)
    out = capsys.readouterr().out
    assert out.startswith(f"Right: MyColumnParallelLinear agrees with the reference on all 4 "
                          f"ranks for 5 inputs: {CASES[0]};"), out
    assert "saved: my_megatron/layers.py (ColumnParallelLinear)" in out
    module = import_file(tmp_path / "my_megatron" / "layers.py")
    assert isinstance(module.ColumnParallelLinear, type)
    assert grading_world.tp == 2 and grading_world.world_size == 4     # the world's groups back


def test_the_labs_solution_passes_under_its_own_name(grading_world, capsys, monkeypatch,
                                                     tmp_path):
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(tmp_path / "my_megatron"))
    solution = _cell(solution_source("06"), "SolutionColumnParallelLinear", "solution")
    assert grade(solution, build.COLUMN_PARALLEL_LINEAR, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: SolutionColumnParallelLinear agrees with the reference"), out
    saved = (tmp_path / "my_megatron" / "layers.py").read_text()
    assert "class ColumnParallelLinear(torch.nn.Module):" in saved
    assert "SolutionColumnParallelLinear" not in saved


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_fails_naming_it(mistake, grading_world, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(tmp_path / "my_megatron"))
    learner = _cell(_mistake(mistake), "MyColumnParallelLinear", mistake.replace(" ", "-"))
    assert not grade(learner, build.COLUMN_PARALLEL_LINEAR, grading_world)
    out = capsys.readouterr().out
    case, said = VERDICTS[mistake]
    assert out.startswith(f"Not yet: rank 0, input '{case}': "), out
    assert said in out, out
    assert "Hint: __init__: draw the whole master weight" in out
    assert "saved:" not in out and not (tmp_path / "my_megatron").exists()


def test_a_missing_f_names_the_missing_all_reduce(grading_world, capsys):
    assert not grade(_cell(_mistake("no f"), "MyColumnParallelLinear", "no-f-2"),
                     build.COLUMN_PARALLEL_LINEAR, grading_world)
    out = capsys.readouterr().out
    assert ": this rank's term dY_i W_i only; the sum over the tensor-parallel group (f's " \
           "backward all-reduce) is missing" in out, out


def test_the_stub_has_no_answer_yet(grading_world, capsys):
    assert not grade(_cell(STUB, "MyColumnParallelLinear", "stub"),
                     build.COLUMN_PARALLEL_LINEAR, grading_world)
    assert capsys.readouterr().out.startswith("No answer yet: MyColumnParallelLinear still "
                                              "raises NotImplementedError")


def test_an_odd_world_is_refused():
    assert "cannot be split in pairs" in build.COLUMN_PARALLEL_LINEAR.ranks_needed(3, 1, 1)
    assert build.COLUMN_PARALLEL_LINEAR.ranks_needed(8, 8, 1) is None
    assert build.COLUMN_PARALLEL_LINEAR.layout(8) == (2, 1)
