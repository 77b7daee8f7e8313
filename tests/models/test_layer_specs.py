"""Megatron-core's module specs in the mirror (core/transformer/spec_utils.py,
core/models/gpt/gpt_layer_specs.py): the default spec builds today's model, and a spec with
other linear classes builds them in the four places Megatron-core's local spec names."""
import pytest
import torch

from mpu_lab.core.models.gpt import GPTModel
from mpu_lab.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from mpu_lab.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mpu_lab.core.transformer import MLP, TransformerConfig
from mpu_lab.core.transformer.mlp import MLPSubmodules
from mpu_lab.core.transformer.spec_utils import ModuleSpec, build_module, get_module

pytestmark = pytest.mark.usefixtures("world")   # a one-rank world (tests/conftest.py)


def config():
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4)


class MyColumn(ColumnParallelLinear):
    pass


class MyRow(RowParallelLinear):
    pass


def double(x):
    return 2 * x


def test_build_module_returns_a_function_and_builds_a_class_with_params_and_submodules():
    assert build_module(double) is double
    assert build_module(ModuleSpec(module=double)) is double
    assert get_module(ModuleSpec(module=("torch.nn", "Linear"))) is torch.nn.Linear
    linear = build_module(ModuleSpec(module=("torch.nn", "Linear"), params={"bias": False}), 3, 4)
    assert linear.weight.shape == (4, 3) and linear.bias is None
    mlp = build_module(ModuleSpec(module=MLP, submodules=MLPSubmodules(MyColumn, MyRow)), config())
    assert type(mlp.linear_fc1) is MyColumn and type(mlp.linear_fc2) is MyRow


def test_a_failed_build_names_the_class():
    with pytest.raises(TypeError, match="when instantiating Linear"):
        build_module(ModuleSpec(module=torch.nn.Linear, params={"no_such_argument": 1}), 3, 4)


def test_the_default_spec_builds_the_same_model_as_no_spec():
    torch.manual_seed(0)
    plain = GPTModel(config(), 64, 16)
    torch.manual_seed(0)
    specced = GPTModel(config(), 64, 16, transformer_layer_spec=get_gpt_layer_local_spec())
    a, b = plain.state_dict(), specced.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, 64, (2, 16))
    assert torch.equal(plain(ids), specced(ids))


def test_the_spec_puts_the_given_linears_in_the_four_places():
    torch.manual_seed(0)
    model = GPTModel(config(), 64, 16, transformer_layer_spec=get_gpt_layer_local_spec(
        column_parallel_linear=MyColumn, row_parallel_linear=MyRow))
    kinds = {name: type(m) for name, m in model.named_modules() if isinstance(m, (MyColumn, MyRow))}
    assert kinds == {f"decoder.layers.{i}.{part}": kind for i in range(2)
                     for part, kind in (("self_attention.linear_qkv", MyColumn),
                                        ("self_attention.linear_proj", MyRow),
                                        ("mlp.linear_fc1", MyColumn), ("mlp.linear_fc2", MyRow))}
