"""Lab 08's checks: what Megatron's collective tests leave on each rank, predicted and held to
Megatron's own assertions (on the layouts of
:data:`~mpu_lab.megatron_reference.collective_layouts.COLLECTIVE_LAYOUTS`), and the write-the-code
exercises :data:`F_EXERCISE` and :data:`G_EXERCISE`: the learner writes the forward and the
backward of f and g (Shoeybi et al. 2019, §3), graded on a playground world against
:func:`~mpu_lab.core.tensor_parallel.mappings.copy_to_tensor_model_parallel_region` and
:func:`~mpu_lab.core.tensor_parallel.mappings.reduce_from_tensor_model_parallel_region`."""
from __future__ import annotations

import ast
import inspect
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from mpu_lab.training import initialize
from mpu_lab.megatron_reference.collective_layouts import COLLECTIVE_LAYOUTS
from mpu_lab.labkit.verdict import Verdict, as_int, check_tensor, tp_group_of, unanswered, verdict
from mpu_lab.labkit.grader import Case, Exercise, Outcome, compare
from mpu_lab.labkit.notebooks.leaks import declare_answers
from mpu_lab.labkit import profiles
from mpu_lab.megatron_reference.layers import MAPPINGS as MEGATRON_NAMES
from mpu_lab.core.tensor_parallel import mappings


def group_sum_of_ranks(rank: int, world_size: int, tp: int, pp: int = 1) -> int:
    """What an all-reduce of each rank's own rank number gives on ``rank`` over its TP group —
    Megatron's copy-to test: 6 on ranks 0-3 and 22 on ranks 4-7 for 8 ranks at tp=4."""
    return sum(tp_group_of(rank, world_size, tp, pp))


def gather_split_expected(rank: int, world_size: int, tp: int, pp: int = 1,
                          shape: Sequence[int] = (2, 4)) -> List[float]:
    """``gather_split_1d_tensor`` of tensors filled with their rank, as seen on ``rank``."""
    group = tp_group_of(rank, world_size, tp, pp)
    numel = 1
    for s in shape:
        numel *= s
    return [float(r) for r in group for _ in range(numel)]


def check_all_reduce_of_ranks(answer: Any, rank: int, world_size: int, tp: int, pp: int = 1) -> Verdict:
    """Predict the all-reduce (sum over the TP group) of the rank numbers, seen on ``rank``."""
    if unanswered(answer, f"the number rank {rank} holds after the all-reduce"):
        return Verdict(False)
    expected = group_sum_of_ranks(rank, world_size, tp, pp)
    return verdict(as_int(answer) == expected,
                    f"rank {rank}'s tensor-parallel group sums to {expected}.",
                    f"{answer!r} is not it. Hint: only the ranks of rank {rank}'s tensor-parallel "
                    f"group take part; add up their rank numbers.")


def check_gather_split(answer: Any, rank: int, world_size: int, tp: int, pp: int = 1,
                       shape: Sequence[int] = (2, 4)) -> Verdict:
    """Predict ``gather_split_1d_tensor`` on ``rank`` when every rank holds ``ones(shape) * rank``."""
    if unanswered(answer, f"the 1-D list of values rank {rank} ends up with"):
        return Verdict(False)
    expected = gather_split_expected(rank, world_size, tp, pp, shape)
    given = answer.tolist() if hasattr(answer, "tolist") else answer
    try:
        given = [float(v) for v in given]
    except (TypeError, ValueError):
        given = None
    group = tp_group_of(rank, world_size, tp, pp)
    return verdict(given == expected,
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
    group = tp_group_of(rank, world_size, tp, pp)
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
    return verdict(ok_all, f"all {world} ranks agree with Megatron's unit tests.",
                    "some values differ from Megatron's unit tests (see above).", reveal=False)



# --------------------------------------------------------------------------- write f and g
def _rank_tensor(spec: Dict[str, Any], rank: int) -> torch.Tensor:
    """A case's tensor on this rank: ``values`` (reshaped to ``shape``) times ``rank + 1`` when
    ``times_rank_plus_1``, plus ``plus_rank`` times the rank; on the rank's device."""
    t = torch.tensor(spec["values"], dtype=torch.float32, device=initialize.get_device())
    t = t.reshape(spec["shape"])
    if spec.get("times_rank_plus_1"):
        t = t * (rank + 1)
    return t + spec.get("plus_rank", 0) * rank


def _as_function(forward: Callable, backward: Callable) -> type:
    """The learner's two functions as an autograd Function (made on the rank: a class defined
    in a notebook does not travel to the ranks, functions do)."""

    class Learners(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return forward(x)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad)

    return Learners


def _run_forward_backward(learner: Tuple[Callable, Callable], case: Case,
                          reference: Callable) -> Outcome:
    """Runs on each rank: the reference first (so its collectives never pair with the learner's),
    then the learner's forward and backward on fresh copies of the same tensors; compares the
    output, then ``x.grad``."""
    forward, backward = learner
    rank = torch.distributed.get_rank()
    x = _rank_tensor(case.params["x"], rank)
    grad = _rank_tensor(case.params["grad"], rank)
    x_ref = x.clone().requires_grad_()
    out_ref = reference(x_ref)
    out_ref.backward(grad.clone())
    x_mine = x.clone().requires_grad_()
    out = _as_function(forward, backward).apply(x_mine)
    seen = compare(f"forward ({forward.__name__}(x))", out_ref, out)
    if not seen.ok:
        return seen
    out.backward(grad.clone())
    return compare(f"x.grad ({backward.__name__}(grad))", x_ref.grad, x_mine.grad)


def run_f_case(learner: Tuple[Callable, Callable], case: Case) -> Outcome:
    """One case of :data:`F_EXERCISE` on this rank, against ``copy_to_tensor_model_parallel_region``."""
    return _run_forward_backward(learner, case, mappings.copy_to_tensor_model_parallel_region)


def run_g_case(learner: Tuple[Callable, Callable], case: Case) -> Outcome:
    """One case of :data:`G_EXERCISE` on this rank, against ``reduce_from_tensor_model_parallel_region``."""
    return _run_forward_backward(learner, case, mappings.reduce_from_tensor_model_parallel_region)


def _spec(values, shape, **per_rank) -> Dict[str, Any]:
    return {"values": [float(v) for v in values], "shape": list(shape), **per_rank}


# Rank-dependent inputs and gradients: a rank that skips its group's all-reduce, or sums over
# the wrong group, holds a different number from the reference.
F_AND_G_CASES = (
    Case("x = [0, 1, 2, 3] + 10 * rank, grad = ones",
         {"x": _spec(range(4), [4], plus_rank=10), "grad": _spec([1] * 4, [4])}),
    Case("x = arange(6).reshape(3, 2) * (rank + 1), grad = arange(6).reshape(3, 2) - 2.5",
         {"x": _spec(range(6), [3, 2], times_rank_plus_1=True),
          "grad": _spec([v - 2.5 for v in range(6)], [3, 2])}),
    Case("one element: x = [rank], grad = [1]",
         {"x": _spec([0], [1], plus_rank=1), "grad": _spec([1], [1])}),
    Case("the same x = [1, 2, 3] on every rank, grad = (rank + 1) * [1, -2, 3]",
         {"x": _spec([1, 2, 3], [3]), "grad": _spec([1, -2, 3], [3], times_rank_plus_1=True)}),
)

F_EXERCISE = Exercise(
    name="f (f_forward, f_backward)", run_case=run_f_case, cases=F_AND_G_CASES,
    parts=("f_forward", "f_backward"),
    hint="f stands before a column-parallel layer: every rank of the tensor-parallel group "
         "already holds the same x, and each computes only part of x's gradient. Which "
         "direction needs a sum, and over which group "
         "(parallel_state.get_tensor_model_parallel_group())?")

G_EXERCISE = Exercise(
    name="g (g_forward, g_backward)", run_case=run_g_case, cases=F_AND_G_CASES,
    parts=("g_forward", "g_backward"),
    hint="g stands after a row-parallel layer: each rank of the tensor-parallel group holds a "
         "partial sum of the output, and the output's gradient is the same on every rank. "
         "Which direction needs a sum, and over which group "
         "(parallel_state.get_tensor_model_parallel_group())?")


# --------------------------------------------------------------------------- the code and the real thing
# f and g as mpu_lab's mappings.py defines them: the public function, its autograd Function and
# the all-reduce helper both use, read from the module's source by name (not imported).
F_AND_G = ("_reduce", "_CopyToModelParallelRegion", "_ReduceFromModelParallelRegion",
           "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region")


def source_of(module, names: Sequence[str]) -> str:
    """The source of the top-level functions and classes ``names`` of ``module``, in the order
    given, separated by a blank line. Raises ``ValueError`` naming a name the module lacks."""
    text = inspect.getsource(module)
    found = {node.name: ast.get_source_segment(text, node) for node in ast.parse(text).body
             if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    absent = [n for n in names if n not in found]
    if absent:
        raise ValueError(f"{module.__name__} defines no {absent}; it defines {sorted(found)}")
    return "\n\n\n".join(found[n] for n in names)


def print_f_and_g_source() -> None:
    """Print f and g from ``mpu_lab/core/tensor_parallel/mappings.py`` (:data:`F_AND_G`)."""
    print(source_of(mappings, F_AND_G))


def _worst(value: float) -> str:
    return "0" if value == 0 else f"{value:.1e}"


def print_side_by_side(results: Sequence[dict]) -> None:
    """``launch/megatron_core_side_by_side.py --what mappings`` in a few lines: per mapping,
    the shapes in and out on rank 0 and the largest difference between mpu_lab and
    Megatron-core over all ranks, forward and backward (0: bit-identical). Prints the job's
    reason instead when it skipped (megatron-core not installed)."""
    if results and "skipped" in results[0]:
        print(results[0]["skipped"])
        return
    first = results[0]
    print(f"megatron-core {first['megatron_core']} and mpu_lab at tp={first['tp']}, the same "
          f"tensors through both on each of {len(results)} ranks;\nrank groups the same on every "
          f"rank: {all(r['groups_equal'] for r in results)}")
    print(f"{'mapping':<44}{'rank 0: in -> out':<28}max |difference| fwd / bwd")
    for name, on_rank0 in first["mappings"].items():
        fwd = max(r["mappings"][name]["forward"] for r in results)
        bwd = max(r["mappings"][name]["backward"] for r in results)
        shape_in, shape_out = on_rank0["shape"]
        print(f"{MEGATRON_NAMES.get(name, name):<44}{f'{shape_in} -> {shape_out}':<28}"
              f"{_worst(fwd)} / {_worst(bwd)}")


def reduce_scatter_sequence_expected(rank: int, world_size: int, tp: int, pp: int = 1,
                                     cols: int = 2) -> List[List[float]]:
    """``reduce_scatter_to_sequence_parallel_region(x)`` on ``rank`` when every rank r holds
    ``x = torch.arange(tp * cols).reshape(tp, cols) * (r + 1)``: the group's sum, of which the
    rank keeps row ``tp_rank`` along the sequence (Korthikanti et al. 2022, §4.2.2)."""
    group = tp_group_of(rank, world_size, tp, pp)
    total, row = sum(r + 1 for r in group), group.index(rank)
    return [[float((row * cols + j) * total) for j in range(cols)]]


def check_reduce_scatter_to_sequence(answer: Any, rank: int, world_size: int, tp: int,
                                     pp: int = 1) -> Verdict:
    """Predict ``reduce_scatter_to_sequence_parallel_region`` on ``rank`` when rank r holds
    ``torch.arange(2. * tp).reshape(tp, 2) * (r + 1)``."""
    group = tp_group_of(rank, world_size, tp, pp)
    return check_tensor(answer, reduce_scatter_sequence_expected(rank, world_size, tp, pp),
                         f"rank {rank}'s tensor, e.g. [[a, b]]",
                         f"row {group.index(rank)} of the sum over the group {group}.",
                         f"Hint: sum the ({tp}, 2) tensors of the group {group}, then rank "
                         f"{rank} keeps row {group.index(rank)} (its tensor-parallel rank).")


# --------------------------------------------------------------------------- answers in sight
# Lab 08's graded answers, computed by the graders above from the arguments the notebook's
# check cells pass (at the stored run's profile, labs/profiles/cpu.yaml, where a cell passes a
# parameter): tests/labs/test_no_answer_before_commit.py searches the notebook for them above
# each answer cell (mpu_lab.labkit.notebooks.leaks).
_STORED_N = profiles.values_for(profiles.load("cpu"), "08_tp_mappings")["world_size"]
declare_answers([
    ("08", "all-reduce of rank numbers on rank 5", group_sum_of_ranks(5, 8, tp=2, pp=4),
     "check_all_reduce_of_ranks("),
    ("08", "gather_split on rank 3", [gather_split_expected(3, 8, tp=4, pp=2)],
     "check_gather_split("),
    ("08", "reduce-scatter to the sequence on rank 5",
     [reduce_scatter_sequence_expected(5, _STORED_N, tp=4, pp=2)],
     "check_reduce_scatter_to_sequence("),
])
