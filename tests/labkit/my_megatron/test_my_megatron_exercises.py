"""A whole-piece exercise saves the learner's code into their package once the grader says it is
right, and only then: graded on the shared 4-rank grading world with lab 07's row-parallel
forward standing in for a piece (its grader is tested in tests/labkit/row_parallel/)."""
import dataclasses
import importlib.util

from mpu_lab.labkit.grader import grade
from mpu_lab.labkit.row_parallel import exercises as row_parallel
from learner_cells import run_cell

RIGHT = '''
def my_row_forward(x, weight, bias, input_is_parallel):
    x_i = x if input_is_parallel else scatter_to_tensor_model_parallel_region(x)
    y = reduce_from_tensor_model_parallel_region(x_i @ weight.t())
    return y if bias is None else y + bias
'''
WRONG = RIGHT.replace("reduce_from_tensor_model_parallel_region(x_i @ weight.t())",
                      "x_i @ weight.t()")


def _cell(source, name):
    return run_cell(source, name)["my_row_forward"]


PIECE = dataclasses.replace(row_parallel.ROW_FORWARD, module="layers.py",
                            saves_as=("row_forward",))


def test_a_right_piece_is_saved_under_the_capstones_name(grading_world, capsys, monkeypatch,
                                                          tmp_path):
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(tmp_path / "my_megatron"))
    assert grade(_cell(RIGHT, "right"), PIECE, grading_world)
    out = capsys.readouterr().out
    assert "saved: my_megatron/layers.py (row_forward)" in out
    path = tmp_path / "my_megatron" / "layers.py"
    spec = importlib.util.spec_from_file_location("saved_layers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.row_forward.__code__.co_varnames[:4] == ("x", "weight", "bias",
                                                            "input_is_parallel")
    assert module.scatter_to_tensor_model_parallel_region is not None   # the ranks' names


def test_a_wrong_piece_is_not_saved(grading_world, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(tmp_path / "my_megatron"))
    assert not grade(_cell(WRONG, "wrong"), PIECE, grading_world)
    assert "saved:" not in capsys.readouterr().out
    assert not (tmp_path / "my_megatron").exists()
