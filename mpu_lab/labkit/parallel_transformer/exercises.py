"""Lab 09's checks: the lecture's shape table on one rank, the tensor-parallel sizes a layer
accepts, a layer's collectives per step (:func:`mpu_lab.perf.comm_counts.expected_layer_counts`: with
sequence parallelism Megatron's re-gather of each column-parallel input in backward included),
Korthikanti et al.'s activation memory, and the write-the-code exercises
:data:`VOCAB_PARALLEL_CE` (the vocab-parallel cross entropy's three all-reduces) and
:data:`VOCAB_PARALLEL_CE_BACKWARD` (its custom backward, softmax minus one-hot on the owning
rank, graded on the gradients of the dense twin), both on a live world."""
from __future__ import annotations

from typing import Any, Callable, List

import torch
import torch.nn.functional as F

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state, tensor_parallel
from mpu_lab.labkit.verdict import Verdict, as_int, as_int_list, unanswered, verdict
from mpu_lab.labkit.grader import Case, Exercise, Outcome, compare, show
from mpu_lab.labkit.notebooks.leaks import declare_answers
from mpu_lab.core.transformer import TransformerConfig
from mpu_lab.perf.layer_shapes import lecture_shapes
from mpu_lab.perf.cost_model import activation_memory_per_layer
from mpu_lab.perf.comm_counts import expected_layer_counts


def check_layer_shape(answer: Any, tensor: str, B: int, L: int, D: int, n_H: int,
                      d_tp: int) -> Verdict:
    """Shape of ``tensor`` (a row of the lecture's table, e.g. ``"A"``) on one rank."""
    if unanswered(answer, f"the shape of {tensor} on one rank, e.g. (B, L, something)"):
        return Verdict(False)
    shapes = lecture_shapes(B, L, D, n_H, d_tp)
    if tensor not in shapes:
        raise ValueError(f"no tensor {tensor!r} in the lecture's table; it has {list(shapes)}")
    expected, per_rank = shapes[tensor]
    given = as_int_list(answer)
    many = f" (each rank holds {per_rank} of them)" if per_rank > 1 else ""
    return verdict(given is not None and tuple(given) == expected,
                    f"{tensor} is {expected} on each of the {d_tp} ranks{many}.",
                    f"{answer!r} is not it. Hint: only the dimensions inside the tensor-parallel "
                    f"blocks (D/d_tp for Q, K, V, Z; 4D/d_tp for A, A') are cut; B and L never "
                    f"are, and Out and x' are whole after the all-reduce.")


def valid_tensor_parallel_sizes(hidden_size: int, num_attention_heads: int) -> List[int]:
    """The sizes ``t`` at which :class:`~mpu_lab.core.transformer.TransformerConfig` accepts the layer
    (whole heads per rank; the MLP splits too)."""
    config = TransformerConfig(num_layers=1, hidden_size=hidden_size,
                               num_attention_heads=num_attention_heads)
    sizes = []
    for t in range(1, num_attention_heads + 1):
        try:
            config.check(t)
        except ValueError:
            continue
        sizes.append(t)
    return sizes


def check_tensor_parallel_sizes(answer: Any, hidden_size: int, num_attention_heads: int) -> Verdict:
    """Every tensor-parallel size that can split a layer of ``num_attention_heads`` heads."""
    if unanswered(answer, "the list of every tensor-parallel size that works"):
        return Verdict(False)
    expected = valid_tensor_parallel_sizes(hidden_size, num_attention_heads)
    given = as_int_list(answer)
    return verdict(given is not None and sorted(given) == expected,
                    f"t in {expected}: each rank must hold whole heads, so t divides "
                    f"n_H = {num_attention_heads} (and so t <= n_H).",
                    f"{answer!r} is not it. Hint: a head is never cut, so n_H / t must be a "
                    f"whole number.")


def _collective_total(counts: dict, kind: str) -> int:
    return sum(direction.get(kind, 0) for direction in counts.values())


def check_layer_collectives(answer: Any, sequence_parallel: bool, tp: int = 2) -> Verdict:
    """Collectives of one transformer layer per training step, forward plus backward:
    ``(all_reduces, all_gathers, reduce_scatters)``."""
    if unanswered(answer, "a triple (all_reduces, all_gathers, reduce_scatters)"):
        return Verdict(False)
    counts = expected_layer_counts(sequence_parallel, tp)
    expected = [_collective_total(counts, k) for k in ("all_reduce", "all_gather", "reduce_scatter")]
    given = as_int_list(answer)
    mode = "with" if sequence_parallel else "without"
    return verdict(given == expected,
                    f"{mode} sequence parallelism one layer issues {tuple(expected)} per step "
                    f"(all-reduces, all-gathers, reduce-scatters), forward and backward together.",
                    f"{answer!r} is not it. Hint: count the f and g of both blocks, forward and "
                    f"backward; with sequence parallelism f becomes an all-gather and g a "
                    f"reduce-scatter, each one's backward is the other, and in backward each "
                    f"column-parallel layer all-gathers its input again for its weight gradient.")


def check_activation_memory_mib(answer: Any, s: int, b: int, h: int, a: int, t: int = 1,
                                sp: bool = False, rtol: float = 0.01) -> Verdict:
    """Korthikanti et al.'s activation memory of one layer, in MiB (within ``rtol``)."""
    if unanswered(answer, "a number of MiB"):
        return Verdict(False)
    expected_bytes = activation_memory_per_layer(s, b, h, a, t, sp)
    expected = expected_bytes / 2 ** 20
    try:
        value = float(answer)
    except (TypeError, ValueError):
        value = None
    mode = f"t = {t}" + (" with sequence parallelism" if sp else "")
    terms = "sbh/t (34 + 5as/h)" if sp else "sbh (10 + 24/t + 5as/(ht))"
    other = activation_memory_per_layer(s, b, h, a, t, not sp) / 2 ** 20
    return verdict(value is not None and abs(value - expected) <= rtol * expected,
                    f"{expected:.0f} MiB per layer at {mode}: {terms} = "
                    f"{expected_bytes:,.0f} bytes (5as/h = "
                    f"{5 * a * s / h:g}); {'without' if sp else 'with'} sequence parallelism "
                    f"{other:.0f} MiB.",
                    f"{answer!r} is not it. Hint: sbh/t (34 + 5as/h) bytes with sequence "
                    f"parallelism, sbh (10 + 24/t + 5as/(ht)) without; 1 MiB = 2^20 bytes.")



def check_ce_backward_collectives(answer: Any) -> Verdict:
    """How many collectives the vocab-parallel cross entropy's backward issues: none
    (Megatron-core's ``_VocabParallelCrossEntropy.backward``, cross_entropy.py). Asked as a
    prediction before the learner writes that backward, answered after it is graded."""
    if unanswered(answer, "the number of collectives you predicted"):
        return Verdict(False)
    return verdict(as_int(answer) == 0,
                   "none. The gradient is softmax(z) - onehot(y), scaled per token by "
                   "grad_output. The softmax slice is already global (the forward's max and sum "
                   "made it so), and the one-hot has its single 1 in the slice of the rank that "
                   "holds y: that rank subtracts it, every other rank leaves its slice alone. "
                   "So the loss costs three small all-reduces forward and nothing backward, "
                   "where gathering the logits would move [s, b, V].",
                   f"{answer!r} is not it. Hint: count the collectives your graded backward "
                   f"calls; which of softmax(z) and onehot(y) does a rank miss for its slice?")


# --------------------------------------------------------------------------- write the code
# The learner writes ``my_vocab_parallel_ce(logits_shard, target, vocab_start, vocab_end)``:
# the per-token loss of logits split along the vocabulary, with Megatron's three all-reduces
# over the tensor-parallel group (max, target logit, sum of exponentials).

def _ce_targets(how: str, n: int, vocab: int, per_rank: int, dp_rank: int) -> torch.Tensor:
    """The case's target ids (global vocabulary ids), different on each data-parallel replica."""
    if how == "first_shard":        # every target in tensor-parallel rank 0's slice
        ids = [(3 * i + dp_rank) % per_rank for i in range(n)]
    elif how == "spread":           # one target in each slice, then round again
        ids = [((i % (vocab // per_rank)) * per_rank + (i + dp_rank) % per_rank) for i in range(n)]
    elif how == "last":             # the last id of the vocabulary, and the first
        ids = [vocab - 1 if i % 2 == 0 else dp_rank for i in range(n)]
    else:
        raise ValueError(f"unknown target layout {how!r}: 'first_shard', 'spread' or 'last'")
    return torch.tensor(ids, dtype=torch.long, device="cpu")  # cpu: moved by run_ce_case


def ce_inputs(params: dict, tp: int, dp_rank: int):
    """The full logits ``[n, V]`` and the targets ``[n]`` of a case, the same on every
    tensor-parallel rank of a replica and different across data-parallel replicas (built on
    the CPU from a seed; :func:`run_ce_case` moves them to the rank's device)."""
    n, per_rank = params["tokens"], params["vocab_per_rank"]
    vocab = per_rank * tp
    gen = torch.Generator().manual_seed(1000 + 17 * dp_rank + n)
    noise = torch.randn(n, vocab, generator=gen, device="cpu")  # cpu: a CPU generator
    logits = params.get("offset", 0.0) + params.get("scale", 3.0) * noise
    return logits, _ce_targets(params["targets"], n, vocab, per_rank, dp_rank)


def run_ce_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank of the grading world: this rank's vocabulary slice of the case's
    logits, the learner's loss against mpu_lab's ``vocab_parallel_cross_entropy`` (which is
    first held against ``F.cross_entropy`` of the full logits)."""
    device = initialize.get_device()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    full, target = ce_inputs(case.params, tp, parallel_state.get_data_parallel_rank())
    per_rank = case.params["vocab_per_rank"]
    start, end = tp_rank * per_rank, (tp_rank + 1) * per_rank
    shard, target = full[:, start:end].contiguous().to(device), target.to(device)
    expected = tensor_parallel.vocab_parallel_cross_entropy(shard.clone(), target.clone())
    dense = F.cross_entropy(full, target.cpu(), reduction="none")
    if not compare("reference", dense, expected, atol=1e-4).ok:
        raise RuntimeError(f"mpu_lab's vocab_parallel_cross_entropy {show(expected)} disagrees "
                           f"with F.cross_entropy of the full logits {show(dense)}")
    got = learner(shard.clone(), target.clone(), start, end)
    return compare(f"with targets {target.tolist()} (vocabulary ids [{start}, {end}) on this "
                   f"rank, logits [{len(target)}, {per_rank}]) the loss", expected, got, atol=1e-4)


# Where the targets sit in the vocabulary slices: the cases both exercises share.
TARGET_LAYOUTS = [
        Case("targets all in rank 0's slice", dict(tokens=6, vocab_per_rank=5,
                                                   targets="first_shard")),
        Case("targets spread over every slice", dict(tokens=7, vocab_per_rank=5,
                                                     targets="spread")),
        Case("the last vocabulary id", dict(tokens=4, vocab_per_rank=3, targets="last")),
]

VOCAB_PARALLEL_CE = Exercise(
    name="my_vocab_parallel_ce",
    run_case=run_ce_case,
    cases=TARGET_LAYOUTS + [
        Case("a single token", dict(tokens=1, vocab_per_rank=4, targets="spread")),
        Case("large logits (exp overflows without the max)",
             dict(tokens=5, vocab_per_rank=5, targets="spread", offset=500.0, scale=40.0)),
    ],
    hint="three all-reduces over parallel_state.get_tensor_model_parallel_group(), never the "
         "whole world: (1) MAX of each row's local max, subtracted before exp; (2) SUM of the "
         "target's shifted logit, which only the rank whose [vocab_start, vocab_end) holds the "
         "target contributes (the others add 0); (3) SUM of each row's sum of exp(logit - max). "
         "loss = log(sum) - target logit.")


# The learner writes ``my_vocab_parallel_ce_backward(softmax_shard, target, vocab_start, vocab_end,
# grad_output)``: Megatron's custom backward of the vocab-parallel cross entropy, the gradient
# of the per-token losses (weighted by ``grad_output``) with respect to this rank's logits.
# Its reference is autograd through ``F.cross_entropy`` of the whole logits, sliced to the rank.

def run_ce_backward_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank of the grading world: the learner's gradient of this rank's logit
    slice against the slice of autograd's gradient through ``F.cross_entropy`` of the full
    logits (mpu_lab's own ``vocab_parallel_cross_entropy`` backward is first held against it)."""
    device = initialize.get_device()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    full, target = ce_inputs(case.params, tp, dp_rank)
    per_rank = case.params["vocab_per_rank"]
    start, end = tp_rank * per_rank, (tp_rank + 1) * per_rank
    gen = torch.Generator().manual_seed(7 + dp_rank)
    grad_output = 0.5 + torch.rand(len(target), generator=gen, device="cpu")  # cpu: a CPU generator
    dense = full.clone().requires_grad_(True)
    (F.cross_entropy(dense, target, reduction="none") * grad_output).sum().backward()
    expected = dense.grad[:, start:end].to(device)
    shard = full[:, start:end].contiguous().to(device).requires_grad_(True)
    loss = tensor_parallel.vocab_parallel_cross_entropy(shard, target.to(device))
    loss.backward(grad_output.to(device))
    if not compare("reference", expected, shard.grad, atol=1e-5).ok:
        raise RuntimeError(f"mpu_lab's vocab_parallel_cross_entropy backward {show(shard.grad)} "
                           f"disagrees with autograd through F.cross_entropy {show(expected)}")
    softmax_shard = torch.softmax(full, dim=-1)[:, start:end].contiguous().to(device)
    got = learner(softmax_shard.clone(), target.to(device), start, end, grad_output.to(device))
    return compare(f"with targets {target.tolist()} (vocabulary ids [{start}, {end}) on this "
                   f"rank) and grad_output {show(grad_output, 3)}, the gradient of the logits",
                   expected, got, atol=1e-5)


VOCAB_PARALLEL_CE_BACKWARD = Exercise(
    name="my_vocab_parallel_ce_backward",
    run_case=run_ce_backward_case,
    cases=TARGET_LAYOUTS,
    hint="the derivative of log-sum-exp(z) - z_y with respect to z is the softmax of z minus the "
         "one-hot of y, and the chain rule multiplies each token's row by its grad_output. "
         "Which rank's slice holds the 1 of the one-hot, and what do the other ranks subtract?")


# --------------------------------------------------------------------------- answers in sight
# Lab 09's graded answers, computed by the graders above from the arguments the notebook's
# check cells pass (at the stored run's profile, labs/profiles/cpu.yaml, where a cell passes a
# parameter): tests/labs/test_no_answer_before_commit.py searches the notebook for them above
# each answer cell (mpu_lab.labkit.notebooks.leaks).
_A_SHAPE = lecture_shapes(B=4, L=1024, D=1024, n_H=16, d_tp=2)["A"][0]
_SP_COUNTS = expected_layer_counts(True, 2)
_SP_TOTALS = tuple(_collective_total(_SP_COUNTS, k)
                   for k in ("all_reduce", "all_gather", "reduce_scatter"))
_ACT_MIB = activation_memory_per_layer(2048, 1, 12288, 96, 8, True) / 2 ** 20
declare_answers([
    ("09", "shape of A on one rank", [tuple(_A_SHAPE)], "check_layer_shape("),
    ("09", "valid tensor-parallel sizes", [valid_tensor_parallel_sizes(768, 12)],
     "check_tensor_parallel_sizes("),
    ("09", "layer collectives with sequence parallelism", [_SP_TOTALS],
     "check_layer_collectives("),
    ("09", "activation memory MiB per layer", [_ACT_MIB, f"{_ACT_MIB:.0f} MiB"],
     "check_activation_memory_mib("),
    ("09", "collectives of the loss's backward", [0, "no collective", "nothing backward"],
     "check_ce_backward_collectives("),
])
