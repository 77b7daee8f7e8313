"""Lab 09's builds on the shared 4-rank grading world (regrouped to tp = 2, pp = 1): the
learner's whole ``VocabParallelEmbedding`` (a class, sent to the ranks as its source) and
``vocab_parallel_cross_entropy`` (a function with its autograd Function inside), against the
mirror's from the same seed (the loss also against ``F.cross_entropy`` of the whole logits).

* Right answers (the learner's own, written here, and the lab's solutions) pass and are saved
  as ``my_megatron/layers.py:VocabParallelEmbedding`` and
  ``my_megatron/cross_entropy.py:vocab_parallel_cross_entropy``.
* Each typical mistake fails with the verdict naming it.
* The stubs have no answer yet.
* Lab 08's and lab 09's solutions, saved by their graders, train the capstone's GPT at TP = 2
  to the mirror's losses.
"""
import re

import pytest

from mpu_lab.labkit.capstone import run_capstone
from mpu_lab.labkit.grader import grade
from mpu_lab.labkit.notebooks.solutions import solution_source
from mpu_lab.labkit.parallel_transformer import build
from mpu_lab.labkit.tp_mappings import build as mappings_build
from learner_cells import run_cell

EMBEDDING = '''
class MyVocabParallelEmbedding(torch.nn.Module):
    def __init__(self, num_embeddings, embedding_dim, init_method=torch.nn.init.normal_,
                 params_dtype=torch.float32, **unused):
        super().__init__()
        from mpu_lab.core.utils import get_device
        t = parallel_state.get_tensor_model_parallel_world_size()
        r = parallel_state.get_tensor_model_parallel_rank()
        self.n = num_embeddings // t
        self.start = r * self.n
        table = torch.empty(num_embeddings, embedding_dim)
        init_method(table)
        block = torch.split(table, self.n, dim=0)[r]
        self.weight = torch.nn.Parameter(block.clone().to(get_device(), params_dtype))

    def forward(self, ids):
        local = ids - self.start
        ok = (local >= 0) & (local < self.n)
        rows = self.weight[local.clamp(0, self.n - 1)]
        rows = rows * ok.unsqueeze(-1)
        return reduce_from_tensor_model_parallel_region(rows)
'''

CROSS_ENTROPY = '''
def my_vocab_parallel_cross_entropy(vocab_parallel_logits, target):
    class CE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z, y):
            group = parallel_state.get_tensor_model_parallel_group()
            n = z.shape[-1]
            lo = parallel_state.get_tensor_model_parallel_rank() * n
            m = z.amax(dim=-1)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            z = z - m[..., None]
            here = (y >= lo) & (y < lo + n)
            idx = torch.where(here, y - lo, torch.zeros_like(y))
            zy = torch.where(here, torch.gather(z, -1, idx[..., None])[..., 0],
                             torch.zeros_like(m))
            dist.all_reduce(zy, group=group)
            e = torch.exp(z)
            s = e.sum(dim=-1)
            dist.all_reduce(s, group=group)
            ctx.save_for_backward(e / s[..., None], here, idx)
            return torch.log(s) - zy

        @staticmethod
        def backward(ctx, dloss):
            p, here, idx = ctx.saved_tensors
            g = p.clone()
            hit = torch.nn.functional.one_hot(idx, p.shape[-1]).to(p.dtype) * here[..., None]
            return (g - hit) * dloss[..., None], None
    return CE.apply(vocab_parallel_logits, target)
'''

STUBS = '''
class MyVocabParallelEmbedding(torch.nn.Module):
    def __init__(self, num_embeddings, embedding_dim, init_method=torch.nn.init.normal_,
                 params_dtype=torch.float32, **unused):
        super().__init__()
        raise NotImplementedError("write __init__")

    def forward(self, ids):
        raise NotImplementedError("write forward")


def my_vocab_parallel_cross_entropy(vocab_parallel_logits, target):
    raise NotImplementedError("write my_vocab_parallel_cross_entropy")
'''

E, C = build.VOCAB_PARALLEL_EMBEDDING, build.VOCAB_PARALLEL_CROSS_ENTROPY
E0, C0 = E.cases[0].name, C.cases[0].name
# mistake -> (source, old, new, the case it fails, the verdict)
MISTAKES = {
    "the hidden dimension cut": (
        EMBEDDING, "block = torch.split(table, self.n, dim=0)[r]",
        "block = torch.split(table, embedding_dim // t, dim=1)[r]", E0,
        "weight's shape expected (4, 4), this rank's rows of the [8, 4] table, got (8, 2): "
        "the hidden dimension cut"),
    "another rank's rows": (
        EMBEDDING, "block = torch.split(table, self.n, dim=0)[r]",
        "block = torch.split(table, self.n, dim=0)[1 - r]", E0,
        "rows block 1 of the table, not block 0"),
    "rows of other ranks' ids left in": (
        EMBEDDING, "        rows = rows * ok.unsqueeze(-1)\n", "", E0,
        ": the ids another rank owns looked up as this rank's first or last row and left in"),
    "no g": (
        EMBEDDING, "return reduce_from_tensor_model_parallel_region(rows)", "return rows", E0,
        ": this rank's rows only: g's all-reduce over the tensor-parallel group"),
    "each rank's own max": (
        CROSS_ENTROPY, "            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)\n", "",
        C0, ": each rank subtracted its own max"),
    "the target logit not summed": (
        CROSS_ENTROPY, "            dist.all_reduce(zy, group=group)\n", "", C0,
        ": the target logit was not summed over the group"),
    "the whole world": (
        CROSS_ENTROPY, "group = parallel_state.get_tensor_model_parallel_group()", "group = None",
        C0,
        ": summed over the whole world of 4 ranks"),
    "no max at all": (
        CROSS_ENTROPY, "            z = z - m[..., None]\n", "", C.cases[3].name,
        ": not finite: exp overflowed; subtract the group's max"),
    "the one-hot on every rank": (
        CROSS_ENTROPY, " * here[..., None]\n", "\n", C0,
        ": the one-hot subtracted on every rank: only the rank that owns the target"),
    "no grad_output": (
        CROSS_ENTROPY, "return (g - hit) * dloss[..., None], None", "return g - hit, None", C0,
        ": softmax minus one-hot, not multiplied by dL/dloss"),
    "the logits all-gathered": (
        CROSS_ENTROPY, "            m = z.amax(dim=-1)\n",
        "            parts = [torch.empty_like(z) for _ in range(2)]\n"
        "            dist.all_gather(parts, z.contiguous(), group=group)\n"
        "            m = torch.cat(parts, dim=-1).amax(dim=-1)\n", C0,
        "the collectives of forward (the values were right) expected 3 all-reduces"),
}


def _cell(source, key):
    """``source`` as the learner's cell (with its own ``import torch``): its namespace."""
    return run_cell("import torch\n" + source, f"vocab-{key}")


def test_the_learners_pieces_pass_and_are_saved(grading_world, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(tmp_path / "my_megatron"))
    assert grade(_cell(EMBEDDING, "e")["MyVocabParallelEmbedding"], E, grading_world)
    assert grade(_cell(CROSS_ENTROPY, "c")["my_vocab_parallel_cross_entropy"], C, grading_world)
    out = capsys.readouterr().out
    assert out.startswith(f"Right: MyVocabParallelEmbedding agrees with the reference on all 4 "
                          f"ranks for 3 inputs: {E0};"), out
    assert "saved: my_megatron/layers.py (VocabParallelEmbedding)" in out
    assert "Right: my_vocab_parallel_cross_entropy agrees with the reference on all 4 ranks " \
           "for 4 inputs" in out
    assert "saved: my_megatron/cross_entropy.py (vocab_parallel_cross_entropy)" in out


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_fails_naming_it(mistake, grading_world, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(tmp_path / "my_megatron"))
    source, old, new, case, said = MISTAKES[mistake]
    assert source.count(old) == 1, mistake
    namespace = _cell(source.replace(old, new), mistake.replace(" ", "-"))
    exercise, name = ((E, "MyVocabParallelEmbedding") if source is EMBEDDING
                      else (C, "my_vocab_parallel_cross_entropy"))
    assert not grade(namespace[name], exercise, grading_world)
    out = capsys.readouterr().out
    # the targets of the first loss case are all rank 0's: there a wrong sum or one-hot shows
    # on rank 1 only
    assert re.match(rf"Not yet: rank [01], input '{re.escape(case)}': ", out), out
    assert said in out, out
    assert "saved:" not in out and not (tmp_path / "my_megatron").exists()


def test_the_stubs_have_no_answer_yet(grading_world, capsys):
    stubs = _cell(STUBS, "stubs")
    assert not grade(stubs["MyVocabParallelEmbedding"], E, grading_world)
    assert not grade(stubs["my_vocab_parallel_cross_entropy"], C, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("No answer yet: MyVocabParallelEmbedding still raises "
                          "NotImplementedError"), out
    assert "No answer yet: my_vocab_parallel_cross_entropy still raises" in out


def test_the_solutions_saved_by_their_graders_train_the_capstones_gpt(grading_world, capsys,
                                                                     monkeypatch, tmp_path):
    package = tmp_path / "my_megatron"
    monkeypatch.setenv("MPU_LAB_MY_MEGATRON", str(package))
    s08, s09 = _cell(solution_source("08"), "solution-08"), _cell(solution_source("09"),
                                                                   "solution-09")
    for exercise in (mappings_build.TP_MAPPINGS, mappings_build.SP_MAPPINGS):
        parts = tuple(s08["solution_" + n[3:]] for n in exercise.parts)
        assert grade(parts, exercise, grading_world)
    assert grade(s09["SolutionVocabParallelEmbedding"], E, grading_world)
    assert grade(s09["solution_vocab_parallel_cross_entropy"], C, grading_world)
    out = capsys.readouterr().out
    assert out.count("saved: my_megatron/") == 4, out
    result = run_capstone(package, 2, 1, train_iters=2, echo=False)
    assert result.exit_code == 0, result.lines
    assert "used: layers.py:VocabParallelEmbedding x1" in result.lines, result.lines
    assert any(line.startswith("used: cross_entropy.py:vocab_parallel_cross_entropy x")
               for line in result.lines), result.lines
    assert any(line.startswith("used: mappings.py:copy_to_tensor_model_parallel_region")
               for line in result.lines), result.lines
    assert result.lines[-1] == "capstone: losses equal the mirror's within 1e-05 over 2 iterations"
