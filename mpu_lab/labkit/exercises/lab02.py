"""Lab 02's checks: a column-parallel weight's shape, and the rows a strided (fused) split keeps."""
from __future__ import annotations

from typing import Any

from mpu_lab.labkit.exercises.common import Verdict, _as_int_list, _unanswered, _verdict
from mpu_lab.labkit.viz.splits import shard_shapes, strided_owners


def _column_weight_shape(input_size: int, output_size: int, tp: int) -> tuple:
    (rows, cols) = shard_shapes("column", input_size, output_size, tp)[0]  # A_i: [in, out/t]
    return (cols, rows)                                                        # W_i = A_i^T


def check_column_weight_shape(answer: Any, input_size: int, output_size: int, tp: int) -> Verdict:
    """Shape of one rank's ``ColumnParallelLinear(input_size, output_size).weight`` at ``tp``."""
    if _unanswered(answer, "a shape such as (rows, cols)"):
        return Verdict(False)
    expected = _column_weight_shape(input_size, output_size, tp)
    given = _as_int_list(answer)
    if given is not None and tuple(given) == expected[::-1] and expected[0] != expected[1]:
        return _verdict(False, "", f"{tuple(given)} is A_i = [in, out/t]; the Parameter stores "
                                   f"W_i = A_i^T because F.linear computes X W^T.")
    return _verdict(given is not None and tuple(given) == expected,
                    f"each rank stores weight {expected}: A_i = [{input_size}, "
                    f"{output_size // tp}] transposed, cut by the tensor-parallel size {tp}.",
                    f"{answer!r} is not it. Hint: the columns of A (output_size) are cut into t "
                    f"pieces, and the weight is stored as [out/t, in].")


def check_strided_rows(answer: Any, rank: int, size: int, tp: int, stride: int) -> Verdict:
    """Which rows of a fused ``[size, ...]`` master weight does ``rank`` keep with ``stride``?"""
    if _unanswered(answer, f"the list of master-weight rows that rank {rank} keeps"):
        return Verdict(False)
    owners = strided_owners(size, tp, stride)
    expected = [row for row, owner in enumerate(owners) if owner == rank]
    given = _as_int_list(answer)
    return _verdict(given is not None and sorted(given) == expected,
                    f"rank {rank} keeps rows {expected}: one piece of {size // (tp * stride)} "
                    f"rows from each of the {stride} fused parts.",
                    f"{answer!r} is not it. Hint: cut the {size} rows into tp*stride = "
                    f"{tp * stride} pieces; rank r keeps pieces r, r+{tp}, r+{2 * tp}, ...")

