"""The learner's package: a right piece is saved from the text the learner typed (as IPython
keeps a cell's text in linecache), a later save of the same name replaces it and leaves the
others, and the file is a module the capstone's own reader (an AST walk) and Python import."""
import ast
import importlib
import importlib.util

import pytest

from mpu_lab.labkit import my_megatron
from learner_cells import import_file, run_cell

CELL = '''\
import torch

def my_f(x):
    """the learner's f"""
    return x + 1

class RowParallelLinear(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        return x * self.n, None
'''


def test_a_function_and_a_notebook_class_are_saved_as_typed_and_import(tmp_path):
    ns = run_cell(CELL, "1")
    path = my_megatron.save_piece([ns["my_f"], ns["RowParallelLinear"]], "layers.py",
                                  ["f", "RowParallelLinear"], where=tmp_path / "pkg")
    text = path.read_text()
    assert '"""the learner\'s f"""' in text and "def f(x):" in text and "def my_f" not in text
    assert "class RowParallelLinear(torch.nn.Module):" in text
    module = import_file(path)
    assert module.f(2) == 3
    assert module.RowParallelLinear(3)(2)[0] == 6
    assert (tmp_path / "pkg" / "__init__.py").exists()
    assert my_megatron.saved_names("layers.py", tmp_path / "pkg") == ["f", "RowParallelLinear"]


def test_saving_again_replaces_that_piece_only(tmp_path):
    first = run_cell(CELL, "2")
    my_megatron.save_piece([first["my_f"], first["RowParallelLinear"]], "layers.py",
                           ["f", "RowParallelLinear"], where=tmp_path)
    second = run_cell("def my_f(x):\n    return x + 2\n", "3")
    path = my_megatron.save_piece([second["my_f"]], "layers.py", ["f"], where=tmp_path)
    tree = ast.parse(path.read_text())
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert sorted(names) == ["RowParallelLinear", "f"]          # one f, the class kept
    assert import_file(path).f(2) == 4


def test_the_folder_defaults_to_the_environment_then_the_working_directory(monkeypatch, tmp_path):
    monkeypatch.setenv(my_megatron.ENV, str(tmp_path / "x"))
    assert my_megatron.folder() == tmp_path / "x"
    monkeypatch.delenv(my_megatron.ENV)
    assert str(my_megatron.folder()) == "my_megatron"


def test_a_name_count_that_does_not_match_is_refused(tmp_path):
    ns = run_cell(CELL, "4")
    with pytest.raises(ValueError, match="2 piece"):
        my_megatron.save_piece([ns["my_f"], ns["RowParallelLinear"]], "x.py", ["f"], where=tmp_path)


def test_the_per_rank_values_a_piece_reads_are_named_with_what_to_call_instead():
    ns = run_cell("def uses(x):\n    return x.to(device) * world_size\n\n"
               "class Layer:\n    def f(self):\n        return [rank for _ in range(2)]\n", "5")
    assert my_megatron.rank_values_read([ns["uses"]]) == [
        "device (use get_device())", "world_size (use dist.get_world_size())"]
    assert my_megatron.rank_values_read([ns["Layer"]]) == ["rank (use dist.get_rank())"]
    assert my_megatron.rank_values_read([run_cell(CELL, "6")["my_f"]]) == []


def test_my_layers_run_on_my_own_mappings_once_saved_and_on_the_mirrors_before(tmp_path):
    """The package's modules import each other as a package does: layers.py takes f from my
    mappings.py where I wrote it, and the mirror's for the ones I have not."""
    import sys
    import types
    from mpu_lab.core.tensor_parallel import mappings as mirror
    layer = run_cell("def uses_f(x):\n    return copy_to_tensor_model_parallel_region\n", "7")
    mine = run_cell("def copy_to_tensor_model_parallel_region(x):\n    return x\n", "8")
    pkg = tmp_path / "pkg"

    def imported():
        for name in [n for n in sys.modules if n.startswith("learner_pkg")]:
            del sys.modules[name]
        package = types.ModuleType("learner_pkg")
        package.__path__ = [str(pkg)]
        sys.modules["learner_pkg"] = package
        return importlib.import_module("learner_pkg.layers")

    my_megatron.save_piece([layer["uses_f"]], "layers.py", where=pkg)
    assert imported().uses_f(0) is mirror.copy_to_tensor_model_parallel_region
    my_megatron.save_piece([mine["copy_to_tensor_model_parallel_region"]], "mappings.py", where=pkg)
    layers = imported()
    assert layers.uses_f(0) is sys.modules["learner_pkg.mappings"].copy_to_tensor_model_parallel_region
    assert layers.uses_f(0) is not mirror.copy_to_tensor_model_parallel_region
    assert layers.reduce_from_tensor_model_parallel_region is \
        mirror.reduce_from_tensor_model_parallel_region              # not written: the mirror's
