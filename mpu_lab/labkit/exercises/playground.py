"""The live-world checks of labs 04-06: predict one rank's tensor before the operator runs.

Each lab runs the operator live on a playground world (:mod:`mpu_lab.labkit.playground`); the
learner predicts one rank's tensor first. The expected tensors below come from the pure
rank-group math and plain Python sums, never from the playground or the mappings themselves.
"""
from __future__ import annotations

from typing import Any, List

from mpu_lab.labkit.exercises.common import (
    Verdict,
    as_floats,
    tp_group_of,
    unanswered,
    verdict,
)


def copy_to_grad_expected(rank: int, world_size: int, tp: int, pp: int = 1,
                          size: int = 4) -> List[float]:
    """``x.grad`` on ``rank`` after ``y = copy_to_tensor_model_parallel_region(x)`` and
    ``y.backward(torch.full((size,), r + 1.0))`` on every rank r: f's backward all-reduces
    dL/dy over the tensor-parallel group (Megatron-LM, Shoeybi et al. 2019, §3, Fig. 3)."""
    return [float(sum(r + 1 for r in tp_group_of(rank, world_size, tp, pp)))] * size


def reduce_from_expected(rank: int, world_size: int, tp: int, pp: int = 1,
                         size: int = 4) -> List[float]:
    """``reduce_from_tensor_model_parallel_region(torch.arange(size) * (r + 1))`` on ``rank``
    when every rank r holds its own multiple of ``arange``: g's forward all-reduce (§3)."""
    total = sum(r + 1 for r in tp_group_of(rank, world_size, tp, pp))
    return [float(i * total) for i in range(size)]


def reduce_scatter_sequence_expected(rank: int, world_size: int, tp: int, pp: int = 1,
                                     cols: int = 2) -> List[List[float]]:
    """``reduce_scatter_to_sequence_parallel_region(x)`` on ``rank`` when every rank r holds
    ``x = torch.arange(tp * cols).reshape(tp, cols) * (r + 1)``: the group's sum, of which the
    rank keeps row ``tp_rank`` along the sequence (Korthikanti et al. 2022, §4.2.2)."""
    group = tp_group_of(rank, world_size, tp, pp)
    total, row = sum(r + 1 for r in group), group.index(rank)
    return [[float((row * cols + j) * total) for j in range(cols)]]


def _check_tensor(answer: Any, expected: List, what: str, why: str, hint: str) -> Verdict:
    if unanswered(answer, what):
        return Verdict(False)
    return verdict(as_floats(answer) == as_floats(expected), f"{expected}: {why}",
                    f"{answer!r} is not it. {hint}")


def check_copy_to_grad(answer: Any, rank: int, world_size: int, tp: int, pp: int = 1) -> Verdict:
    """Predict ``x.grad`` on ``rank`` after f with dL/dy = rank + 1 on every rank (4 values)."""
    group = tp_group_of(rank, world_size, tp, pp)
    return _check_tensor(answer, copy_to_grad_expected(rank, world_size, tp, pp),
                         f"rank {rank}'s x.grad, a list of 4 numbers",
                         f"the sum of r + 1 over the group {group}.",
                         f"Hint: f's backward all-reduces dL/dy over rank {rank}'s "
                         f"tensor-parallel group {group}; each rank r sent r + 1.")


def check_reduce_from(answer: Any, rank: int, world_size: int, tp: int, pp: int = 1) -> Verdict:
    """Predict g's output on ``rank`` when rank r holds ``torch.arange(4.) * (r + 1)``."""
    group = tp_group_of(rank, world_size, tp, pp)
    return _check_tensor(answer, reduce_from_expected(rank, world_size, tp, pp),
                         f"rank {rank}'s tensor after reduce_from, a list of 4 numbers",
                         f"arange(4) times the sum of r + 1 over the group {group}.",
                         f"Hint: g all-reduces (sums) over rank {rank}'s tensor-parallel group "
                         f"{group}, element by element.")


def check_reduce_scatter_to_sequence(answer: Any, rank: int, world_size: int, tp: int,
                                     pp: int = 1) -> Verdict:
    """Predict ``reduce_scatter_to_sequence_parallel_region`` on ``rank`` when rank r holds
    ``torch.arange(2. * tp).reshape(tp, 2) * (r + 1)``."""
    group = tp_group_of(rank, world_size, tp, pp)
    return _check_tensor(answer, reduce_scatter_sequence_expected(rank, world_size, tp, pp),
                         f"rank {rank}'s tensor, e.g. [[a, b]]",
                         f"row {group.index(rank)} of the sum over the group {group}.",
                         f"Hint: sum the ({tp}, 2) tensors of the group {group}, then rank "
                         f"{rank} keeps row {group.index(rank)} (its tensor-parallel rank).")
