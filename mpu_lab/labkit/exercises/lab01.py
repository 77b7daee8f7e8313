"""Lab 01's checks: which ranks form a group, and which groups cross a node boundary."""
from __future__ import annotations

from typing import Any

from mpu_lab import parallel_state
from mpu_lab.labkit.exercises.common import Verdict, _as_int, _as_int_list, _unanswered, _verdict
from mpu_lab.labkit.viz.rank_groups import groups_crossing_nodes


def check_group_of_rank(answer: Any, rank: int, family: str, world_size: int, tp: int = 1,
                        pp: int = 1, cp: int = 1, order: str = parallel_state.DEFAULT_ORDER) -> Verdict:
    """Is ``answer`` the ``family`` group (e.g. ``"dp"``) that holds ``rank``, in Megatron's order?"""
    if _unanswered(answer, f"the list of ranks in rank {rank}'s {family} group"):
        return Verdict(False)
    groups = parallel_state.generate_rank_groups(world_size, tp, pp, cp, order)
    (expected,) = [g for g in groups[family] if rank in g]
    given = _as_int_list(answer)
    if given is not None and sorted(given) == sorted(expected) and given != expected:
        return _verdict(False, "", f"the right ranks, but Megatron lists them as {expected}; "
                                   f"order the ranks by their {family} rank (ascending here).")
    hint = (f"{family} groups hold ranks that agree on every coordinate except {family}; with "
            f"order {order!r}, rank = tp_rank + t*(cp_rank + c*(dp_rank + d*pp_rank)).")
    return _verdict(given == expected, f"rank {rank}'s {family} group is {expected}.",
                    f"{answer!r} is not rank {rank}'s {family} group. Hint: {hint}")


def check_crossing_count(answer: Any, family: str, world_size: int, tp: int = 1, pp: int = 1,
                         cp: int = 1, order: str = parallel_state.DEFAULT_ORDER,
                         gpus_per_node: int = 8) -> Verdict:
    """How many ``family`` groups have ranks in more than one box of ``gpus_per_node`` GPUs?"""
    if _unanswered(answer, f"the number of {family} groups that cross a node boundary"):
        return Verdict(False)
    groups = parallel_state.generate_rank_groups(world_size, tp, pp, cp, order)
    crossing = groups_crossing_nodes(groups[family], gpus_per_node)
    return _verdict(_as_int(answer) == len(crossing),
                    f"{len(crossing)} of {len(groups[family])} {family} groups cross a node "
                    f"boundary: {crossing}.",
                    f"{answer!r} is not it. Hint: node k holds ranks {gpus_per_node}k ... "
                    f"{gpus_per_node}k+{gpus_per_node - 1}; list the {family} groups with "
                    f"generate_rank_groups and look for one that straddles such a boundary.")

