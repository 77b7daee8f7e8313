"""Lab 01's checks: which ranks form a group, which groups cross a node boundary, and the
write-the-code exercise :data:`RANK_GROUPS` (the learner's own rank-group generator, graded on
every rank of a live playground world)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state
from mpu_lab.labkit.verdict import Verdict, as_int, as_int_list, unanswered, verdict
from mpu_lab.labkit.grader import Case, Exercise, Outcome
from mpu_lab.labkit.notebooks.leaks import declare_answers
from mpu_lab.labkit.rank_groups.viz import groups_crossing_nodes


def group_of_rank(rank: int, family: str, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1,
                  order: str = parallel_state.DEFAULT_ORDER) -> List[int]:
    """The ``family`` group that holds ``rank``, in Megatron's order."""
    groups = parallel_state.generate_rank_groups(world_size, tp, pp, cp, order)
    (group,) = [g for g in groups[family] if rank in g]
    return group


def crossing_groups(family: str, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1,
                    order: str = parallel_state.DEFAULT_ORDER,
                    gpus_per_node: int = 8) -> List[List[int]]:
    """The ``family`` groups with ranks in more than one box of ``gpus_per_node`` GPUs."""
    groups = parallel_state.generate_rank_groups(world_size, tp, pp, cp, order)
    return groups_crossing_nodes(groups[family], gpus_per_node)


def check_group_of_rank(answer: Any, rank: int, family: str, world_size: int, tp: int = 1,
                        pp: int = 1, cp: int = 1, order: str = parallel_state.DEFAULT_ORDER) -> Verdict:
    """Is ``answer`` the ``family`` group (e.g. ``"dp"``) that holds ``rank``, in Megatron's order?"""
    if unanswered(answer, f"the list of ranks in rank {rank}'s {family} group"):
        return Verdict(False)
    expected = group_of_rank(rank, family, world_size, tp, pp, cp, order)
    given = as_int_list(answer)
    right = f"rank {rank}'s {family} group is {expected}."
    if given is not None and sorted(given) == sorted(expected) and given != expected:
        return verdict(False, right, f"the right ranks, but Megatron lists them as {expected}; "
                                     f"order the ranks by their {family} rank (ascending here).")
    hint = (f"{family} groups hold ranks that agree on every coordinate except {family}; with "
            f"order {order!r}, rank = tp_rank + t*(cp_rank + c*(dp_rank + d*pp_rank)).")
    return verdict(given == expected, right,
                    f"{answer!r} is not rank {rank}'s {family} group. Hint: {hint}")


def check_crossing_count(answer: Any, family: str, world_size: int, tp: int = 1, pp: int = 1,
                         cp: int = 1, order: str = parallel_state.DEFAULT_ORDER,
                         gpus_per_node: int = 8) -> Verdict:
    """How many ``family`` groups have ranks in more than one box of ``gpus_per_node`` GPUs?"""
    if unanswered(answer, f"the number of {family} groups that cross a node boundary"):
        return Verdict(False)
    groups = parallel_state.generate_rank_groups(world_size, tp, pp, cp, order)
    crossing = crossing_groups(family, world_size, tp, pp, cp, order, gpus_per_node)
    return verdict(as_int(answer) == len(crossing),
                    f"{len(crossing)} of {len(groups[family])} {family} groups cross a node "
                    f"boundary: {crossing}.",
                    f"{answer!r} is not it. Hint: node k holds ranks {gpus_per_node}k ... "
                    f"{gpus_per_node}k+{gpus_per_node - 1}; list the {family} groups with "
                    f"generate_rank_groups and look for one that straddles such a boundary.")


# --------------------------------------------------------------------------- write the code
FAMILIES = ("tp", "dp", "pp")
# Names whose use means the learner's function asks mpu_lab for the answer instead of computing it.
_REFERENCE_NAMES = frozenset({"generate_rank_groups", "rank_coordinates", "get_group_ranks",
                              "RankGenerator"})


def _names_used(fn, depth: int = 3) -> set:
    """The global names ``fn``'s code (nested functions included) refers to, and those of the
    functions it wraps (the grader hands ``run_case`` the learner's function in a wrapper)."""
    names, codes = set(), [getattr(fn, "__code__", None)]
    while codes:
        code = codes.pop()
        if code is not None:
            names |= set(code.co_names)
            codes += [c for c in code.co_consts if hasattr(c, "co_names")]
    inner = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
             if callable(getattr(c, "cell_contents", None))]
    inner += [fn.__wrapped__] if hasattr(fn, "__wrapped__") else []
    for f in inner if depth else ():
        names |= _names_used(f, depth - 1)
    return names


def _as_groups(got: Any) -> Optional[List[List[int]]]:
    """The learner's answer as a list of int lists, or None when it is not one."""
    if isinstance(got, (str, bytes, dict)) or got is None:
        return None
    try:
        groups = [as_int_list(g) for g in got]
    except TypeError:
        return None
    return None if any(g is None for g in groups) else groups


def _group_of(member: int, got: List[List[int]], ref: List[List[int]], what: str) -> Outcome:
    """Compare the learner's group holding ``member`` with the reference's."""
    (expected,) = [g for g in ref if member in g]
    holding = [g for g in got if member in g]
    if len(holding) != 1:
        return Outcome(False, what, str(expected),
                       f"{member} in {len(holding)} groups" + (f": {holding[:3]}" if holding else ""))
    return Outcome(holding[0] == expected, what, str(expected), str(holding[0]))


def _learner_groups(learner: Callable, n: int, tp: int, pp: int, label: str):
    """Call the learner's function for every family: ``({family: groups}, first Outcome that
    says the answer is not a list of rank lists, or None)``."""
    used = sorted(_REFERENCE_NAMES & _names_used(learner))
    if used:
        return {}, Outcome(False, "how the groups are computed", "your own arithmetic (rebuilding "
                           "generate_rank_groups is the exercise)", f"a call to {', '.join(used)}")
    answers, bad = {}, None
    for fam in FAMILIES:
        got = learner(n, tp, pp, fam)
        answers[fam] = _as_groups(got)
        if answers[fam] is None and bad is None:
            bad = Outcome(False, f"the {fam} groups ({label})",
                          "a list of rank lists, e.g. [[0, 1], [2, 3]]", f"{got!r:.60}")
    return answers, bad


def _static_case(learner: Callable, n: int, tp: int, pp: int) -> Outcome:
    """Pure arithmetic: this rank checks the groups of GPUs rank, rank + W, rank + 2W ... of an
    n-GPU job (W = this world's size), so the ranks share the job between them."""
    label = f"n={n}, t={tp}, p={pp}"
    answers, bad = _learner_groups(learner, n, tp, pp, label)
    if bad is not None:
        return bad
    ref = parallel_state.generate_rank_groups(n, tp, pp)
    for fam in FAMILIES:
        for gpu in range(dist.get_rank(), n, dist.get_world_size()):
            out = _group_of(gpu, answers[fam], ref[fam], f"the {fam} group of GPU {gpu} ({label})")
            if not out.ok:
                return out
        if len(answers[fam]) != len(ref[fam]):
            return Outcome(False, f"the number of {fam} groups ({label})", str(len(ref[fam])),
                           f"{len(answers[fam])}: {answers[fam]!r:.60}")
    return Outcome(True)


def _live_case(learner: Callable) -> Outcome:
    """This world's own sizes: the learner's group of this rank must be the reference's, the
    process group this rank really sits in, and the group every one of its members computed
    (an all_gather of each rank's groups over the world)."""
    n = dist.get_world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rank, label = dist.get_rank(), f"this world: n={n}, t={tp}, p={pp}"
    answers, bad = _learner_groups(learner, n, tp, pp, label)
    ref = parallel_state.generate_rank_groups(n, tp, pp)
    outcomes: Dict[str, Outcome] = {}
    # row f: my group as a mask, filled on the host and moved to the rank's device to be gathered
    mine = torch.zeros(len(FAMILIES), n, dtype=torch.int64, device="cpu")  # cpu: filled here
    for i, fam in enumerate(FAMILIES):
        if bad is None:
            outcomes[fam] = _group_of(rank, answers[fam], ref[fam],
                                      f"the {fam} group of rank {rank} ({label})")
            holding = [g for g in answers[fam] if rank in g]
            if len(holding) == 1:
                mine[i, [r for r in holding[0] if 0 <= r < n]] = 1
    device = initialize.get_device()
    everyone = [torch.zeros_like(mine, device=device) for _ in range(n)]
    dist.all_gather(everyone, mine.to(device))                   # every rank joins, always
    if bad is not None:
        return bad
    for i, fam in enumerate(FAMILIES):
        if not outcomes[fam].ok:
            return outcomes[fam]
        live = parallel_state.get_group_ranks(fam)
        group = [r for r in range(n) if mine[i, r]]
        if group != sorted(live):
            return Outcome(False, f"the {fam} group of rank {rank} against the live process "
                           f"group it sits in ({label})", str(live), str(group))
        for member in group:
            theirs = [r for r in range(n) if everyone[member][i, r]]
            if theirs != group:
                return Outcome(False, f"rank {member}'s {fam} group as rank {member} computed it "
                               f"(it holds rank {rank}; {label})", str(group), str(theirs))
    return Outcome(True)


def run_rank_groups(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank: the learner's ``my_groups(world_size, tp, pp, family)`` for the
    ``tp``, ``dp`` and ``pp`` families against :func:`mpu_lab.core.parallel_state.generate_rank_groups`
    (Megatron-core's default order ``tp-cp-ep-dp-pp``, cp = ep = 1: the groups of
    ``tp-cp-dp-pp``)."""
    if case.params.get("live"):
        return _live_case(learner)
    return _static_case(learner, case.params["n"], case.params["tp"], case.params["pp"])


RANK_GROUPS = Exercise(
    name="my_groups",
    module="parallel_state.py",       # saved into the learner's package once right
    run_case=run_rank_groups,
    cases=[
        Case("the lab's world (its n, t, p), checked against its live process groups",
             {"live": True}),
        Case("16 GPUs, t=2, p=4 (the MPU walkthrough's first table)", {"n": 16, "tp": 2, "pp": 4}),
        Case("16 GPUs, t=4, p=2 (the walkthrough's second table)", {"n": 16, "tp": 4, "pp": 2}),
        Case("24 GPUs, t=4, p=2 (d=3)", {"n": 24, "tp": 4, "pp": 2}),
        Case("8 GPUs, t=1, p=4 (no tensor parallelism)", {"n": 8, "tp": 1, "pp": 4}),
        Case("8 GPUs, t=2, p=1 (no pipeline)", {"n": 8, "tp": 2, "pp": 1}),
        Case("8 GPUs, t=8, p=1 (t = n: one tensor-parallel group)", {"n": 8, "tp": 8, "pp": 1}),
        Case("1 GPU", {"n": 1, "tp": 1, "pp": 1}),
    ],
    hint=("in Megatron-core's default order tp-cp-ep-dp-pp with c = ep = 1 (the same groups "
          "as tp-cp-dp-pp), rank = tp_rank + t*(dp_rank + d*pp_rank), d = n/(t*p). A family's "
          "group holds the ranks that share every coordinate except that family's. List each "
          "group in ascending rank order."),
)


# --------------------------------------------------------------------------- answers in sight
# Lab 01's graded answers, computed by the graders above from the arguments the notebook's
# check cells pass: tests/labs/test_no_answer_before_commit.py searches the notebook for them
# above each answer cell (mpu_lab.labkit.notebooks.leaks).
_DP_GROUP = group_of_rank(rank=6, family="dp", world_size=32, tp=4, pp=2)
_CROSSING = crossing_groups("tp", world_size=24, tp=4, pp=2, gpus_per_node=6)
declare_answers([
    ("01", "rank 6's dp group", [_DP_GROUP], "check_group_of_rank("),
    ("01", "tp groups crossing a node", [len(_CROSSING), _CROSSING,
                                         f"{len(_CROSSING)} tp groups cross"],
     "check_crossing_count("),
])
