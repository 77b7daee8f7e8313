"""Lab 08's build on the shared 4-rank grading world (the build regroups it to tp = 2, pp = 1,
so d = 2): the learner's seven mapping functions, typed in a notebook cell, each applying an
autograd Function defined inside it, graded forward and backward against the mirror's
(tests/tensor_parallel holds those to hand-worked values) and by the collectives each issues,
worked out by hand in the build's table.

* A right answer (the learner's own, written here with other calls than the lab's solution)
  passes and is saved as ``my_megatron/mappings.py`` under Megatron's names; the lab's solution
  is graded in tests/labkit/vocab_build, where the capstone's GPT then trains on it.
* Each typical mistake fails with the verdict naming it: f's backward without its all-reduce,
  g's backward with one, the whole world's group, the block along the wrong dimension, a block
  left non-contiguous, the sequence gather's backward without its sum.
* The stubs have no answer yet.
"""
import importlib.util

import pytest

from mpu_lab.labkit.grader import grade
from mpu_lab.labkit.tp_mappings import build
from learner_cells import run_cell

TP = '''
def my_copy_to_tensor_model_parallel_region(x):
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            out = grad.contiguous().clone()
            dist.all_reduce(out, group=parallel_state.get_tensor_model_parallel_group())
            return out
    return F.apply(x)


def my_reduce_from_tensor_model_parallel_region(x):
    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out = x.contiguous().clone()
            dist.all_reduce(out, group=parallel_state.get_tensor_model_parallel_group())
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad
    return G.apply(x)


def my_scatter_to_tensor_model_parallel_region(x):
    class S(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            n = x.shape[-1] // parallel_state.get_tensor_model_parallel_world_size()
            r = parallel_state.get_tensor_model_parallel_rank()
            return x[..., r * n:(r + 1) * n].contiguous()

        @staticmethod
        def backward(ctx, grad):
            group = parallel_state.get_tensor_model_parallel_group()
            parts = [torch.zeros_like(grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, grad.contiguous(), group=group)
            return torch.cat(parts, dim=grad.dim() - 1)
    return S.apply(x)


def my_gather_from_tensor_model_parallel_region(x):
    class A(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            group = parallel_state.get_tensor_model_parallel_group()
            parts = [torch.zeros_like(x) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, x.contiguous(), group=group)
            return torch.cat(parts, dim=x.dim() - 1)

        @staticmethod
        def backward(ctx, grad):
            n = grad.shape[-1] // parallel_state.get_tensor_model_parallel_world_size()
            r = parallel_state.get_tensor_model_parallel_rank()
            return grad[..., r * n:(r + 1) * n].contiguous()
    return A.apply(x)
'''

SP = '''
def my_scatter_to_sequence_parallel_region(x):
    class S(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            n = x.shape[0] // parallel_state.get_tensor_model_parallel_world_size()
            r = parallel_state.get_tensor_model_parallel_rank()
            return x[r * n:(r + 1) * n].contiguous()

        @staticmethod
        def backward(ctx, grad):
            group = parallel_state.get_tensor_model_parallel_group()
            parts = [torch.zeros_like(grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, grad.contiguous(), group=group)
            return torch.cat(parts)
    return S.apply(x)


def my_gather_from_sequence_parallel_region(x):
    class A(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            group = parallel_state.get_tensor_model_parallel_group()
            parts = [torch.zeros_like(x) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, x.contiguous(), group=group)
            return torch.cat(parts)

        @staticmethod
        def backward(ctx, grad):
            total = grad.contiguous().clone()
            dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
            n = grad.shape[0] // parallel_state.get_tensor_model_parallel_world_size()
            r = parallel_state.get_tensor_model_parallel_rank()
            return total[r * n:(r + 1) * n].contiguous()
    return A.apply(x)


def my_reduce_scatter_to_sequence_parallel_region(x):
    class R(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            total = x.contiguous().clone()
            dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
            n = x.shape[0] // parallel_state.get_tensor_model_parallel_world_size()
            r = parallel_state.get_tensor_model_parallel_rank()
            return total[r * n:(r + 1) * n].contiguous()

        @staticmethod
        def backward(ctx, grad):
            group = parallel_state.get_tensor_model_parallel_group()
            parts = [torch.zeros_like(grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, grad.contiguous(), group=group)
            return torch.cat(parts)
    return R.apply(x)
'''

STUB = "\n".join(f'''
def my_{name}(x):
    raise NotImplementedError("write my_{name}")
''' for name in build.SPEC)

TP_CASE, SP_CASE = build.TP_MAPPINGS.cases[0].name, build.SP_MAPPINGS.cases[0].name
# mistake -> (source, the line it changes, what it becomes, the case it fails, the verdict)
MISTAKES = {
    "f without its backward all-reduce": (
        TP, "            dist.all_reduce(out, group=parallel_state."
            "get_tensor_model_parallel_group())\n            return out\n    return F.apply(x)",
        "            return out\n    return F.apply(x)", TP_CASE,
        "my_copy_to_tensor_model_parallel_region(x), backward: dL/dX for the case's dL/dY "
        "expected shape (4, 2, 6)"),
    "g's backward all-reduces": (
        TP, "        def backward(ctx, grad):\n            return grad\n    return G.apply(x)",
        "        def backward(ctx, grad):\n            grad = grad.clone()\n"
        "            dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())"
        "\n            return grad\n    return G.apply(x)", TP_CASE,
        ": the sum over the tensor-parallel group (an all-reduce)"),
    "the whole world's group": (
        TP, "            out = x.contiguous().clone()\n            dist.all_reduce(out, group="
            "parallel_state.get_tensor_model_parallel_group())",
        "            out = x.contiguous().clone()\n            dist.all_reduce(out)", TP_CASE,
        ": the sum over the whole world of 4 ranks, not over the tensor-parallel group"),
    "the block along dim 0": (
        TP, "            return x[..., r * n:(r + 1) * n].contiguous()",
        "            return x.chunk(2, dim=0)[r].contiguous()", TP_CASE,
        "my_scatter_to_tensor_model_parallel_region(x), forward expected shape (4, 2, 3)"),
    "a non-contiguous block": (
        TP, "            return x[..., r * n:(r + 1) * n].contiguous()",
        "            return x[..., r * n:(r + 1) * n]", TP_CASE,
        "the right values as a non-contiguous view (strides (12, 6, 1)): add .contiguous()"),
    "the sequence gather's backward without its sum": (
        SP, "            total = grad.contiguous().clone()\n            dist.all_reduce(total, "
            "group=parallel_state.get_tensor_model_parallel_group())\n            n = grad",
        "            total = grad.contiguous().clone()\n            n = grad", SP_CASE,
        ": this rank's block of dim 0 (the sequence)"),
}


def _cell(source, key):
    """``source`` as the learner's cell (with its own ``import torch``): its namespace."""
    return run_cell("import torch\n" + source, f"mappings-{key}")


def _parts(namespace, exercise, prefix="my_"):
    return tuple(namespace[prefix + n[3:]] for n in exercise.parts)


def test_the_learners_mappings_pass_and_are_saved(grading_world, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(tmp_path / "my_megatron"))
    assert grade(_parts(_cell(TP, "tp"), build.TP_MAPPINGS), build.TP_MAPPINGS, grading_world)
    assert grade(_parts(_cell(SP, "sp"), build.SP_MAPPINGS), build.SP_MAPPINGS, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: my_tensor_parallel_mappings agrees with the reference on all "
                          "4 ranks for 3 inputs: x [4, 2, 6];"), out
    assert "Right: my_sequence_parallel_mappings agrees" in out
    assert out.count("saved: my_megatron/mappings.py (") == 2, out
    spec = importlib.util.spec_from_file_location("saved", tmp_path / "my_megatron" / "mappings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in build.SPEC:           # the learner's, not the header's import of the mirror's
        assert getattr(module, name).__module__ == "saved", name
    assert grading_world.tp == 2 and grading_world.world_size == 4


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_fails_naming_it(mistake, grading_world, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(tmp_path / "my_megatron"))
    source, old, new, case, said = MISTAKES[mistake]
    assert source.count(old) == 1, mistake
    exercise = build.TP_MAPPINGS if source is TP else build.SP_MAPPINGS
    learner = _parts(_cell(source.replace(old, new), mistake.replace(" ", "-")), exercise)
    assert not grade(learner, exercise, grading_world)
    out = capsys.readouterr().out
    assert out.startswith(f"Not yet: rank 0, input '{case}': "), out
    assert said in out, out
    assert "saved:" not in out and not (tmp_path / "my_megatron").exists()


def test_the_stubs_have_no_answer_yet(grading_world, capsys):
    stubs = _cell(STUB, "stub")
    assert not grade(_parts(stubs, build.TP_MAPPINGS), build.TP_MAPPINGS, grading_world)
    assert not grade(_parts(stubs, build.SP_MAPPINGS), build.SP_MAPPINGS, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("No answer yet: my_copy_to_tensor_model_parallel_region still raises "
                          "NotImplementedError"), out
    assert "No answer yet: my_scatter_to_sequence_parallel_region still raises" in out


def test_an_odd_world_is_refused():
    assert "cannot be split in pairs" in build.TP_MAPPINGS.ranks_needed(3, 1, 1)
    assert build.SP_MAPPINGS.layout(8) == (2, 1)
    assert build.TP_MAPPINGS.saves_as + build.SP_MAPPINGS.saves_as == tuple(build.SPEC)
