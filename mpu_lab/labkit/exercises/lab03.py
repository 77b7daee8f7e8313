"""Lab 03's checks: a row-parallel weight's shape, and the all-reduces of a tensor-parallel MLP."""
from __future__ import annotations

from typing import Any

from mpu_lab.labkit.exercises.common import Verdict, _as_int_list, _unanswered, _verdict
from mpu_lab.labkit.viz.splits import shard_shapes


def check_row_weight_shape(answer: Any, input_size: int, output_size: int, tp: int) -> Verdict:
    """Shape of one rank's ``RowParallelLinear(input_size, output_size).weight`` at ``tp``."""
    if _unanswered(answer, "a shape such as (rows, cols)"):
        return Verdict(False)
    (rows, cols) = shard_shapes("row", input_size, output_size, tp)[0]  # A_i: [in/t, out]
    expected = (cols, rows)
    given = _as_int_list(answer)
    if given is not None and tuple(given) == (rows, cols) and rows != cols:
        return _verdict(False, "", f"{(rows, cols)} is A_i = [in/t, out]; the Parameter stores "
                                   f"W_i = A_i^T because F.linear computes X W^T.")
    return _verdict(given is not None and tuple(given) == expected,
                    f"each rank stores weight {expected}: A_i = [{rows}, {cols}] transposed, "
                    f"the rows of A cut by the tensor-parallel size {tp}.",
                    f"{answer!r} is not it. Hint: the rows of A (input_size) are cut into t "
                    f"pieces, and the weight is stored as [out, in/t].")


# Collectives of one tensor-parallel MLP, Column(gather_output=False) -> Row(input_is_parallel=True):
# forward: f is the identity, g all-reduces once; backward: g is the identity, f all-reduces once.
MLP_ALL_REDUCES = {"forward": 1, "backward": 1}


def check_mlp_all_reduces(answer: Any) -> Verdict:
    """All-reduces of one tensor-parallel MLP (Megatron-LM §3): ``(forward, backward)``."""
    if _unanswered(answer, "a pair (forward, backward) of counts"):
        return Verdict(False)
    given = _as_int_list(answer)
    expected = [MLP_ALL_REDUCES["forward"], MLP_ALL_REDUCES["backward"]]
    return _verdict(given == expected,
                    "one all-reduce forward (g after the row-parallel layer) and one backward "
                    "(f before the column-parallel layer).",
                    f"{answer!r} is not it. Hint: with gather_output=False and "
                    f"input_is_parallel=True nothing is gathered or scattered; only f and g "
                    f"communicate, each in one direction.")

