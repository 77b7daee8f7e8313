"""Lab 14's checks: the loss of an untrained model, the micro-batches of a launch line, and
Megatron's padded vocabulary."""
from __future__ import annotations

import math
from typing import Any

from mpu_lab.labkit.verdict import Verdict, as_floats, as_int, unanswered, verdict
from mpu_lab.labkit.notebooks import leaks
from mpu_lab.labkit.train_gpt.runs import LECTURE_GPT_ARGS, derived
from mpu_lab.core.models.gpt import pad_vocab_size


def check_micro_batches(answer: Any, gpt_args: str, world_size: int) -> Verdict:
    """Micro-batches each data-parallel replica runs per iteration for a launch line."""
    if unanswered(answer, "the number of micro-batches per iteration"):
        return Verdict(False)
    d = derived(gpt_args, world_size)
    return verdict(as_int(answer) == d["num_micro_batches"],
                    f"DP = {world_size} / (TP x PP) = {d['data_parallel_size']}, so "
                    f"{d['num_micro_batches']} micro-batch(es) = global batch / (micro batch x DP).",
                    f"{answer!r} is not it. Hint: first DP = world size / (TP x PP); then "
                    f"global batch = micro batch x micro-batches x DP.")


def check_padded_vocab(answer: Any, vocab_size: int, divisible_by: int, tp: int) -> Verdict:
    """The vocabulary Megatron pads ``vocab_size`` to at tensor-parallel size ``tp``."""
    if unanswered(answer, "the padded vocabulary size"):
        return Verdict(False)
    expected = pad_vocab_size(vocab_size, divisible_by, tp)
    return verdict(as_int(answer) == expected,
                    f"{expected} = the next multiple of {divisible_by} x {tp} = "
                    f"{divisible_by * tp}; each rank holds {expected // tp} rows of the embedding.",
                    f"{answer!r} is not it. Hint: round {vocab_size} up to a multiple of "
                    f"--make-vocab-size-divisible-by x TP, so every rank holds the same number "
                    f"of whole rows.")



def check_initial_loss(answer: Any, padded_vocab_size: int, rtol: float = 0.02) -> Verdict:
    """The loss at iteration 1 of a GPT whose softmax runs over ``padded_vocab_size`` ids: a
    freshly initialised model gives every id about the same logit, so ``ln V``."""
    if unanswered(answer, "the loss you expect at iteration 1 (a number)"):
        return Verdict(False)
    values = as_floats(answer)
    expected = math.log(padded_vocab_size)
    ok = values is not None and len(values) == 1 and abs(values[0] - expected) <= rtol * expected
    return verdict(ok, f"ln {padded_vocab_size} = {expected:.3f}: small random weights give "
                        f"every one of the {padded_vocab_size} ids (dummies included) about the "
                        f"same logit, so the model guesses uniformly and the loss is -ln(1/V).",
                    f"{answer!r} is not it. Hint: at iteration 1 the weights are small and random, "
                    f"so every id gets about the same logit. What probability does the softmax "
                    f"then give the right id, and what is -ln of it?")


# --------------------------------------------------------------------------- answers
# What lab 14's graded questions answer, for the leak check (mpu_lab.labkit.notebooks.leaks):
# the first run's vocabulary (512 ids at TP = 2, the CPU profile's), the lecture's line on
# 16 GPUs, GPT-2's vocabulary at TP = 4.
_FIRST_VOCAB = pad_vocab_size(512, 128, 2)
_LECTURE_ON_16 = derived(LECTURE_GPT_ARGS, 16)["num_micro_batches"]
leaks.declare_answers([
    ("14", "initial loss", [math.log(_FIRST_VOCAB), f"ln {_FIRST_VOCAB}", f"ln({_FIRST_VOCAB})"],
     "check_initial_loss("),
    ("14", "micro-batches on 16 GPUs", [_LECTURE_ON_16, f"{_LECTURE_ON_16} micro-batch"],
     "check_micro_batches("),
    ("14", "padded vocabulary", [pad_vocab_size(50257, 128, 4)], "check_padded_vocab("),
])
