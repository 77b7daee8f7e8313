"""Lab 04's checks: what Megatron's collective tests leave on each rank, predicted and held to
Megatron's own assertions (on the layouts of
:data:`~mpu_lab.labkit.collective_layouts.COLLECTIVE_LAYOUTS`)."""
from __future__ import annotations

from typing import Any, List, Sequence

from mpu_lab.labkit.collective_layouts import COLLECTIVE_LAYOUTS
from mpu_lab.labkit.exercises.common import (
    Verdict,
    _as_int,
    _tp_group_of,
    _unanswered,
    _verdict,
)


def group_sum_of_ranks(rank: int, world_size: int, tp: int, pp: int = 1) -> int:
    """What an all-reduce of each rank's own rank number gives on ``rank`` over its TP group —
    Megatron's copy-to test: 6 on ranks 0-3 and 22 on ranks 4-7 for 8 ranks at tp=4."""
    return sum(_tp_group_of(rank, world_size, tp, pp))


def gather_split_expected(rank: int, world_size: int, tp: int, pp: int = 1,
                          shape: Sequence[int] = (2, 4)) -> List[float]:
    """``gather_split_1d_tensor`` of tensors filled with their rank, as seen on ``rank``."""
    group = _tp_group_of(rank, world_size, tp, pp)
    numel = 1
    for s in shape:
        numel *= s
    return [float(r) for r in group for _ in range(numel)]


def check_all_reduce_of_ranks(answer: Any, rank: int, world_size: int, tp: int, pp: int = 1) -> Verdict:
    """Predict the all-reduce (sum over the TP group) of the rank numbers, seen on ``rank``."""
    if _unanswered(answer, f"the number rank {rank} holds after the all-reduce"):
        return Verdict(False)
    expected = group_sum_of_ranks(rank, world_size, tp, pp)
    return _verdict(_as_int(answer) == expected,
                    f"rank {rank}'s tensor-parallel group sums to {expected}.",
                    f"{answer!r} is not it. Hint: only the ranks of rank {rank}'s tensor-parallel "
                    f"group take part; add up their rank numbers.")


def check_gather_split(answer: Any, rank: int, world_size: int, tp: int, pp: int = 1,
                       shape: Sequence[int] = (2, 4)) -> Verdict:
    """Predict ``gather_split_1d_tensor`` on ``rank`` when every rank holds ``ones(shape) * rank``."""
    if _unanswered(answer, f"the 1-D list of values rank {rank} ends up with"):
        return Verdict(False)
    expected = gather_split_expected(rank, world_size, tp, pp, shape)
    given = answer.tolist() if hasattr(answer, "tolist") else answer
    try:
        given = [float(v) for v in given]
    except (TypeError, ValueError):
        given = None
    group = _tp_group_of(rank, world_size, tp, pp)
    return _verdict(given == expected,
                    f"{len(expected)} values: each of the ranks {group} contributes its "
                    f"{len(expected) // len(group)} flattened elements, in group order.",
                    f"that is not it ({len(given) if given else 0} values given, "
                    f"{len(expected)} expected). Hint: flatten each rank's tensor and "
                    f"concatenate over the tensor-parallel group, lowest rank first.")


def _ranges(by_value: dict) -> str:
    return ", ".join(f"ranks {rs[0]}-{rs[-1]} hold {v:g}" if len(rs) > 1 else f"rank {rs[0]} holds {v:g}"
                     for v, rs in by_value.items())


def _megatron_expectation(name: str, rank: int, got: dict, world_size: int) -> bool:
    """Megatron's unit-test assertion for test ``name`` on ``rank`` (layouts of COLLECTIVE_LAYOUTS)."""
    tp, pp = COLLECTIVE_LAYOUTS[name]
    group = _tp_group_of(rank, world_size, tp, pp)
    pos = group.index(rank)
    if name == "broadcast":
        return got["src"] == group[0] and got["means"] == [0.0, 1.0]
    if name in ("copy", "reduce"):
        return got["value"] == sum(group)
    if name == "scatter":
        return got["column"] == pos
    if name == "gather":
        return got["blocks"] == group
    if name == "gather_split":
        return got["output"] == gather_split_expected(rank, world_size, tp, pp)
    if name == "sequence":
        return got["rows"] == [2 * pos, 2 * pos + 2] and got["reduce_scatter"] == tp * pos
    raise ValueError(f"unknown test {name!r}")


def check_megatron_expectations(results: Sequence[dict]) -> Verdict:
    """Hold every rank's values from ``launch/collectives.py`` to Megatron's unit tests.

    One line per test; for copy-to and reduce-from it spells out the famous sums (6 on ranks
    0-3 and 22 on ranks 4-7 for 8 ranks at tp=4). Expectations come from the rank-group math,
    so they hold for any multiple of 8 ranks.
    """
    world = len(results)
    ok_all = True
    for name in results[0]["tests"]:
        ok = all(_megatron_expectation(name, r, res["tests"][name], world)
                 for r, res in enumerate(results))
        ok_all &= ok
        detail = ""
        if name in ("copy", "reduce"):
            by_value = {}
            for r, res in enumerate(results):
                by_value.setdefault(res["tests"][name]["value"], []).append(r)
            detail = ": " + _ranges(by_value)
        tp, pp = COLLECTIVE_LAYOUTS[name]
        print(f"{name:<12} (tp={tp}, pp={pp}) {'as Megatron expects' if ok else 'DIFFERS from Megatron'}"
              f"{detail}")
    return _verdict(ok_all, f"all {world} ranks agree with Megatron's unit tests.",
                    "some values differ from Megatron's unit tests (see above).")

