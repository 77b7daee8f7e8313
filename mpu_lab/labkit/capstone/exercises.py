"""Lab 18's questions and their checks: where a broken piece makes the capstone part from the
mirror, and how many instances of a piece the trained model holds. Each answer is worked out
here from the capstone's own rules (a forward that is wrong changes the first loss; two
row-parallel linears per layer, :data:`~mpu_lab.labkit.capstone.lesson.LAYERS_PER_STAGE`
layers per stage), not read from a run."""
from __future__ import annotations

from typing import Any

from mpu_lab.labkit.capstone.lesson import LAYERS_PER_STAGE
from mpu_lab.labkit.notebooks.leaks import declare_answers
from mpu_lab.labkit.verdict import Verdict, as_int, unanswered, verdict

# a RowParallelLinear per layer in attention (linear_proj) and one in the MLP (linear_fc2)
ROW_LINEARS_PER_LAYER = 2


def parting_iteration(broken_in: str) -> int:
    """The first iteration whose loss or gradient norm parts when a piece is wrong in its
    ``"forward"`` (the first loss already) or only in its ``"backward"`` (the first
    gradients: the first iteration's gradient norm, its loss still equal)."""
    if broken_in not in ("forward", "backward"):
        raise ValueError(f"broken_in={broken_in!r}: 'forward' or 'backward'")
    return 1


def row_instances(pipeline_model_parallel_size: int) -> int:
    """``RowParallelLinear`` instances in one copy of the model (one tensor- and data-parallel
    rank, every pipeline stage): what ``used: layers.py:RowParallelLinear xN`` counts."""
    return ROW_LINEARS_PER_LAYER * LAYERS_PER_STAGE * pipeline_model_parallel_size


def check_parting_iteration(answer: Any) -> Verdict:
    """The broken RowParallelLinear (forward wrong): at which iteration do the runs part?"""
    if unanswered(answer, "an iteration number: 1, 2 or 3"):
        return Verdict(False)
    n, right = as_int(answer), parting_iteration("forward")
    return verdict(
        n == right,
        f"{right}. The first loss is computed by a forward through the broken layer, before "
        f"any update: it differs at once.",
        f"{answer!r}. Which computation gives the first loss, and does it pass through "
        f"RowParallelLinear's forward?")


def check_row_instances(answer: Any, pipeline_model_parallel_size: int) -> Verdict:
    """How many RowParallelLinear instances does the capstone count (one copy of the model)?"""
    if unanswered(answer, "a whole number"):
        return Verdict(False)
    right = row_instances(pipeline_model_parallel_size)
    return verdict(
        as_int(answer) == right,
        f"{right}: {ROW_LINEARS_PER_LAYER} per layer (attention's output projection, the "
        f"MLP's second linear) x {LAYERS_PER_STAGE} layers per stage x "
        f"{pipeline_model_parallel_size} stages; the tensor- and data-parallel copies are not "
        f"counted again.",
        f"{answer!r}. Count one copy of the model: which linears of a layer are row-parallel, "
        f"and how many layers do the stages hold together?")


# answers in sight (tests/labs/test_no_answer_before_commit.py), at the notebook's defaults
declare_answers([
    ("18", "broken forward parts at", [parting_iteration("forward"), "at iteration 1",
                                       "parts first, at iteration 1"],
     "check_parting_iteration("),
    ("18", "row-parallel instances", [row_instances(2), "RowParallelLinear x8"],
     "check_row_instances("),
])
