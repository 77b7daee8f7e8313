"""Lab 14's checks: the loss of an untrained model, the micro-batches of a launch line, and
Megatron's padded vocabulary."""
from __future__ import annotations

import math
from typing import Any

from mpu_lab.labkit.verdict import Verdict, as_floats, as_int, unanswered, verdict
from mpu_lab.labkit.train_gpt.runs import derived
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
