"""Lab 09's write-the-code exercise on the shared 4-rank grading world (tp = 2, dp = 2): the
vocab-parallel cross entropy. The solution passes; each plausible mistake fails with the rank,
the input, the expected and the got values; the stub says there is no answer yet."""
import torch
import torch.nn.functional as F

from mpu_lab.labkit.grader import grade
from mpu_lab.labkit.parallel_transformer import exercises as parallel_transformer
from mpu_lab.labkit.notebooks.solutions import solution_source

# The lab's solution, as labs/solutions/ holds it (the learner loads it with %load): it must pass
# under its own name, and the verdict must name it, not the learner's function.
OWN_SOLUTION = solution_source("09")

STUB = '''
def my_vocab_parallel_ce(logits_shard, target, vocab_start, vocab_end):
    raise NotImplementedError("write the three all-reduces")
'''

SOLUTION = '''
def my_vocab_parallel_ce(logits_shard, target, vocab_start, vocab_end):
    group = parallel_state.get_tensor_model_parallel_group()
    row_max = logits_shard.max(dim=1).values
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    mine = torch.arange(vocab_start, vocab_end, device=target.device) == target[:, None]
    target_logit = (logits_shard * mine).sum(dim=1)
    dist.all_reduce(target_logit, group=group)
    sum_exp = (logits_shard - row_max[:, None]).exp().sum(dim=1)
    dist.all_reduce(sum_exp, group=group)
    return sum_exp.log() + row_max - target_logit
'''


def wrong(old: str, new: str, source: str = SOLUTION) -> str:
    assert old in source, old
    return source.replace(old, new)


# Each rank subtracts its own maximum: the sums of exp of the slices are then on different
# scales (and the loss adds back this rank's maximum only).
LOCAL_MAX = wrong("    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)\n", "")
# Every rank adds "its" target logit, also the ranks that do not hold the target (clamped index).
UNMASKED = wrong("(logits_shard * mine).sum(dim=1)",
                 "logits_shard.gather(1, (target - vocab_start).clamp(0, logits_shard.size(1) - 1)"
                 "[:, None])[:, 0]")
# The sums over the whole world: the data-parallel replicas' different tokens are added together.
WORLD = wrong("dist.all_reduce(sum_exp, group=group)", "dist.all_reduce(sum_exp)",
              wrong("dist.all_reduce(target_logit, group=group)", "dist.all_reduce(target_logit)"))
# No max at all: right for small logits, inf for large ones.
NO_MAX = wrong("(logits_shard - row_max[:, None]).exp()", "logits_shard.exp()",
               wrong("sum_exp.log() + row_max - target_logit", "sum_exp.log() - target_logit"))


def test_the_cases_inputs_against_hand_worked_values():
    """Independent of the grader: the targets of each layout (worked by hand for tp = 2, 5 ids
    per rank) and the large-logits case really overflows a plain exp."""
    _, t = parallel_transformer.ce_inputs(dict(tokens=6, vocab_per_rank=5, targets="first_shard"), 2, 1)
    assert t.tolist() == [1, 4, 2, 0, 3, 1]           # (3 i + 1) % 5: all below 5
    _, t = parallel_transformer.ce_inputs(dict(tokens=7, vocab_per_rank=5, targets="spread"), 2, 0)
    assert t.tolist() == [0, 6, 2, 8, 4, 5, 1]        # both slices [0, 5) and [5, 10)
    _, t = parallel_transformer.ce_inputs(dict(tokens=4, vocab_per_rank=3, targets="last"), 2, 1)
    assert t.tolist() == [5, 1, 5, 1]
    big, t = parallel_transformer.ce_inputs(dict(tokens=5, vocab_per_rank=5, targets="spread", offset=500.0,
                                  scale=40.0), 2, 0)
    assert not torch.isfinite(big.exp().sum(dim=1)).all()
    assert torch.isfinite(F.cross_entropy(big, t)).item()


def test_the_solution_passes(grading_world, as_notebook, capsys):
    assert grade(as_notebook(OWN_SOLUTION)["solution_vocab_parallel_ce"],
                 parallel_transformer.VOCAB_PARALLEL_CE, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: solution_vocab_parallel_ce agrees with the reference on all 4 ranks "
                          "for 5 inputs"), out


def test_the_stub_has_no_answer_yet(grading_world, as_notebook, capsys):
    assert not grade(as_notebook(STUB)["my_vocab_parallel_ce"], parallel_transformer.VOCAB_PARALLEL_CE,
                     grading_world)
    assert capsys.readouterr().out.startswith("No answer yet: my_vocab_parallel_ce still raises")


def _verdict(source, grading_world, as_notebook, capsys) -> str:
    assert not grade(as_notebook(source)["my_vocab_parallel_ce"], parallel_transformer.VOCAB_PARALLEL_CE,
                     grading_world)
    return capsys.readouterr().out


def test_a_local_max_fails_on_the_first_input(grading_world, as_notebook, capsys):
    out = _verdict(LOCAL_MAX, grading_world, as_notebook, capsys)
    assert out.startswith("Not yet: rank 0, input 'targets all in rank 0's slice': with targets "
                          "[0, 3, 1, 4, 2, 0] (vocabulary ids [0, 5) on this rank"), out
    assert "expected shape (6,) [" in out and ", got shape (6,) [" in out and "Hint:" in out


def test_an_unmasked_target_logit_fails(grading_world, as_notebook, capsys):
    out = _verdict(UNMASKED, grading_world, as_notebook, capsys)
    assert out.startswith("Not yet: rank 0, input 'targets all in rank 0's slice'"), out
    assert "expected shape (6,)" in out and "got shape (6,)" in out


def test_reducing_over_the_world_instead_of_the_tensor_parallel_group_fails(
        grading_world, as_notebook, capsys):
    out = _verdict(WORLD, grading_world, as_notebook, capsys)
    assert out.startswith("Not yet: rank 0, input 'targets all in rank 0's slice'"), out


def test_no_max_is_right_until_the_logits_are_large(grading_world, as_notebook, capsys):
    out = _verdict(NO_MAX, grading_world, as_notebook, capsys)
    assert out.startswith("Not yet: rank 0, input 'large logits (exp overflows without the max)'"), out
    assert "got shape (5,) [nan" in out or "got shape (5,) [inf" in out, out


def test_a_layers_collectives_worked_by_hand_from_the_paper(capsys):
    """Korthikanti et al. 2022, §4.2.2, and Megatron-core's linear, counted by hand: without
    sequence parallelism 2 all-reduces (g) forward and 2 (f) backward; with it forward 2
    all-gathers (f) and 2 reduce-scatters (g), backward 2 reduce-scatters (f), 2 all-gathers (g)
    and 2 more all-gathers re-gathering the QKV and fc1 inputs: (0, 6, 4) per step."""
    assert parallel_transformer.check_layer_collectives((0, 6, 4), sequence_parallel=True)
    assert parallel_transformer.check_layer_collectives([4, 0, 0], sequence_parallel=False)
    assert not parallel_transformer.check_layer_collectives((0, 4, 4), sequence_parallel=True)
    assert not parallel_transformer.check_layer_collectives(None, sequence_parallel=True)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Right: with sequence parallelism one layer issues (0, 6, 4)"), out
    assert out[2].startswith("Not yet: (0, 4, 4) is not it."), out
    assert out[3].startswith("No answer yet:"), out


# --------------------------------------------------------------------------- the backward
BACKWARD_STUB = '''
def my_vocab_parallel_ce_backward(softmax_shard, target, vocab_start, vocab_end, grad_output):
    raise NotImplementedError
'''
# Every rank subtracts "its" one-hot, also the ranks that do not hold the target (clamped index).
BACKWARD_EVERY_RANK = '''
def my_vocab_parallel_ce_backward(softmax_shard, target, vocab_start, vocab_end, grad_output):
    grad = softmax_shard.clone()
    local = (target - vocab_start).clamp(0, softmax_shard.size(1) - 1)
    grad[torch.arange(len(target)), local] -= 1.0
    return grad * grad_output[:, None]
'''
# The one-hot right, the chain rule forgotten: grad_output is not 1 in the cases.
BACKWARD_NO_GRAD_OUTPUT = '''
def my_vocab_parallel_ce_backward(softmax_shard, target, vocab_start, vocab_end, grad_output):
    grad = softmax_shard.clone()
    mine = (target >= vocab_start) & (target < vocab_end)
    grad[torch.arange(len(target))[mine], target[mine] - vocab_start] -= 1.0
    return grad
'''


def test_the_backward_solution_passes(grading_world, as_notebook, capsys):
    assert grade(as_notebook(OWN_SOLUTION)["solution_vocab_parallel_ce_backward"],
                 parallel_transformer.VOCAB_PARALLEL_CE_BACKWARD, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: solution_vocab_parallel_ce_backward agrees with the reference "
                          "on all 4 ranks for 3 inputs"), out


def test_the_backward_stub_has_no_answer_yet(grading_world, as_notebook, capsys):
    assert not grade(as_notebook(BACKWARD_STUB)["my_vocab_parallel_ce_backward"],
                     parallel_transformer.VOCAB_PARALLEL_CE_BACKWARD, grading_world)
    assert capsys.readouterr().out.startswith("No answer yet: my_vocab_parallel_ce_backward")


def test_a_one_hot_on_every_rank_fails_on_the_rank_without_the_targets(
        grading_world, as_notebook, capsys):
    assert not grade(as_notebook(BACKWARD_EVERY_RANK)["my_vocab_parallel_ce_backward"],
                     parallel_transformer.VOCAB_PARALLEL_CE_BACKWARD, grading_world)
    out = capsys.readouterr().out
    # tp rank 0 holds every target of the first input: rank 1 (ids [5, 10)) is the first wrong.
    assert out.startswith("Not yet: rank 1, input 'targets all in rank 0's slice'"), out
    assert "the gradient of the logits" in out and "Hint:" in out


def test_forgetting_grad_output_fails(grading_world, as_notebook, capsys):
    assert not grade(as_notebook(BACKWARD_NO_GRAD_OUTPUT)["my_vocab_parallel_ce_backward"],
                     parallel_transformer.VOCAB_PARALLEL_CE_BACKWARD, grading_world)
    assert capsys.readouterr().out.startswith(
        "Not yet: rank 0, input 'targets all in rank 0's slice'")


def test_the_backward_reference_against_a_gradient_worked_by_hand():
    """Independent of the grader: for logits z = (0, log 3) and target 1, softmax is
    (1/4, 3/4), so d loss / dz = (1/4, 3/4 - 1) = (0.25, -0.25); times grad_output 2."""
    z = torch.tensor([[0.0, float(torch.log(torch.tensor(3.0)))]], requires_grad=True)
    (F.cross_entropy(z, torch.tensor([1]), reduction="none") * 2.0).sum().backward()
    assert torch.allclose(z.grad, torch.tensor([[0.5, -0.5]]), atol=1e-6)
