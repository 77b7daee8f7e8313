"""Lab 08's build (issue 42): the learner's own ``mappings.py``, the seven communication
operators of tensor and sequence parallelism as Megatron-core's ``tensor_parallel/mappings.py``
has them, each a function whose autograd Function pairs a forward with its conjugate backward
(Shoeybi et al. 2019, §3; Korthikanti et al. 2022, §4.2.2). Once right they are saved into the
learner's package as ``my_megatron/mappings.py`` under Megatron's names, the names the capstone
(lab 18) reads:

=================================================  ============================  ==============
function                                           forward                       backward
=================================================  ============================  ==============
``copy_to_tensor_model_parallel_region`` (f)       identity                      all-reduce
``reduce_from_tensor_model_parallel_region`` (g)   all-reduce                    identity
``scatter_to_tensor_model_parallel_region``        this rank's block, last dim   all-gather, last
``gather_from_tensor_model_parallel_region``       all-gather, last dim          block, last dim
``scatter_to_sequence_parallel_region``            this rank's block, dim 0      all-gather, 0
``gather_from_sequence_parallel_region``           all-gather, dim 0             reduce-scatter
``reduce_scatter_to_sequence_parallel_region``     reduce-scatter, dim 0         all-gather, 0
=================================================  ============================  ==============

Two exercises: :data:`TP_MAPPINGS` (the first four) and :data:`SP_MAPPINGS` (the sequence
three). Each case draws a different ``x`` on every rank (and a different ``dL/dY``), so a sum
over the wrong group, or no sum, shows in the values. Each function is held, on every rank of
a TP = 2 world (the grader's ``layout``), to the mirror's
(:mod:`mpu_lab.core.tensor_parallel.mappings`, tested against hand-worked values in
tests/tensor_parallel), in this order:

* forward: the output's values (<= 1e-6); a wrong one is named by what it equals, worked out
  here with ``torch.distributed`` on the same ``x`` (no communication, the sum over the group,
  the sum over the whole world, this rank's block or the all-gather along the other dimension,
  another rank's block, ...); a split returned as a non-contiguous view (``.contiguous()``
  forgotten: the next collective or ``view`` needs the memory in order); the collectives it
  issued (:class:`~mpu_lab.labkit.c10d_calls.C10dCalls`) against the table above;
* backward (``torch.autograd.grad`` with the case's ``dL/dY``): the same three checks on
  ``dL/dX``.

A rank moves on only when every rank passed (a MIN all-reduce over the world), so a wrong
forward on one rank never leaves its peers waiting in backward.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from mpu_lab.core import parallel_state
from mpu_lab.core.tensor_parallel import mappings
from mpu_lab.labkit.c10d_calls import C10dCalls
from mpu_lab.labkit.column_parallel.build import (counted_text, same_collectives, on_every_rank,
                                                  tp_pairs, two_tp_ranks)
from mpu_lab.labkit.grader import Case, Exercise, Outcome, show
from mpu_lab.training import initialize

TOL = 1e-6      # absolute and relative, fp32: the operators only move and add numbers

# Megatron's name -> (forward, backward), each one of the operations of _operation()
SPEC: Dict[str, Tuple[str, str]] = {
    "copy_to_tensor_model_parallel_region": ("identity", "all-reduce"),
    "reduce_from_tensor_model_parallel_region": ("all-reduce", "identity"),
    "scatter_to_tensor_model_parallel_region": ("block of the last dim", "all-gather, last dim"),
    "gather_from_tensor_model_parallel_region": ("all-gather, last dim", "block of the last dim"),
    "scatter_to_sequence_parallel_region": ("block of dim 0", "all-gather, dim 0"),
    "gather_from_sequence_parallel_region": ("all-gather, dim 0", "reduce-scatter, dim 0"),
    "reduce_scatter_to_sequence_parallel_region": ("reduce-scatter, dim 0", "all-gather, dim 0"),
}
COLLECTIVE = {"identity": [], "all-reduce": ["all-reduce"], "block of the last dim": [],
              "block of dim 0": [], "all-gather, last dim": ["all-gather"],
              "all-gather, dim 0": ["all-gather"], "reduce-scatter, dim 0": ["reduce-scatter"]}
MEANING = {
    "identity": "the tensor unchanged (no communication)",
    "all-reduce": "the sum over the tensor-parallel group (an all-reduce)",
    "block of the last dim": "this rank's block of the last dimension",
    "block of dim 0": "this rank's block of dim 0 (the sequence)",
    "all-gather, last dim": "the group's blocks concatenated along the last dimension",
    "all-gather, dim 0": "the group's blocks concatenated along dim 0 (the sequence)",
    "reduce-scatter, dim 0": "this rank's block of dim 0 of the sum over the group "
                             "(a reduce-scatter)",
    "reduce-scatter, last dim": "this rank's block of the last dimension of the sum over the "
                                "group (a reduce-scatter along the wrong dimension)",
}


# --------------------------------------------------------------------------- worked out here
def _gathered(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _summed(x: torch.Tensor, group) -> torch.Tensor:
    out = x.detach().clone()
    dist.all_reduce(out, group=group)
    return out


def _candidates(x: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
    """What a slip may return for ``x``, each named: every operation of the table on the
    tensor-parallel group, and the slips of group, dimension and rank. Runs the same
    collectives on every rank (in the same order), outside the learner's calls."""
    tp = parallel_state.get_tensor_model_parallel_group()
    t = parallel_state.get_tensor_model_parallel_world_size()
    r = parallel_state.get_tensor_model_parallel_rank()
    n = dist.get_world_size()
    x = x.detach()
    total, world_total = _summed(x, tp), _summed(x, None)
    found = [("identity", x), ("all-reduce", total)]
    for dim, where in ((-1, "last dim"), (0, "dim 0")):
        along = "the last dimension" if dim else "dim 0"
        if x.shape[dim] % t == 0:
            found.append(("block of the last dim" if dim else "block of dim 0",
                          x.chunk(t, dim=dim)[r]))
            found += [(f"block {k} along {along}, not block {r}: this rank keeps the "
                       f"block of its tensor-parallel rank", x.chunk(t, dim=dim)[k])
                      for k in range(t) if k != r]
            found.append((f"reduce-scatter, {where}", total.chunk(t, dim=dim)[r]))
        found.append((f"all-gather, {where}", _gathered(x, dim, tp)))
        found.append((f"the all-gather along {along} over the whole world of {n} ranks: "
                      f"use the tensor-parallel group", _gathered(x, dim, None)))
    found.append((f"the sum over the whole world of {n} ranks, not over the tensor-parallel "
                  f"group (parallel_state.get_tensor_model_parallel_group())", world_total))
    if x.shape[0] % t == 0:
        found.append((f"this rank's block of dim 0 of the sum over the whole world of {n} "
                      f"ranks: use the tensor-parallel group", world_total.chunk(t, dim=0)[r]))
    return found


def _name_of(got: torch.Tensor, candidates: Sequence[Tuple[str, torch.Tensor]]) -> str:
    for key, value in candidates:
        if tuple(value.shape) == tuple(got.shape) and torch.allclose(
                got.detach().float().cpu(), value.float().cpu(), atol=TOL, rtol=TOL):
            return MEANING.get(key, key)
    return ""


def _same(got, expected: torch.Tensor) -> bool:
    return (isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(expected.shape)
            and bool(got.isfinite().all()) and torch.allclose(
                got.detach().float().cpu(), expected.detach().float().cpu(), atol=TOL, rtol=TOL))


def _verdict(what: str, op: str, got, expected: torch.Tensor, candidates, calls: List[str],
             contiguous_matters: bool) -> Outcome:
    """One direction of one operator: values, then contiguity, then the collectives."""
    want = f"{show(expected)}, {MEANING[op]}"
    if not isinstance(got, torch.Tensor):
        return Outcome(False, what, want, f"{type(got).__name__} {got!r:.60}")
    if not _same(got, expected):
        named = _name_of(got, candidates)
        return Outcome(False, what, want, show(got) + (f": {named}" if named else ""))
    if contiguous_matters and not got.is_contiguous():
        return Outcome(False, what, f"{MEANING[op]}, contiguous in memory", f"the right values "
                       f"as a non-contiguous view (strides {tuple(got.stride())}): add "
                       f".contiguous(), as Megatron does; the next all-gather or view needs "
                       f"the block's memory in order")
    if not same_collectives(calls, COLLECTIVE[op]):
        return Outcome(False, f"{what}: its collectives (the values were right)",
                       counted_text(COLLECTIVE[op]), counted_text(calls))
    return Outcome(True)


# --------------------------------------------------------------------------- one case
def _rank_tensor(shape: Sequence[int], seed: int, strided: bool) -> torch.Tensor:
    """A tensor of ``shape`` drawn from ``seed`` and this rank's global rank (different on
    every rank), on the rank's device; with ``strided``, a non-contiguous view of it (the
    transpose of a tensor laid out the other way)."""
    g = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    if strided:
        x = torch.randn(*reversed(list(shape)),  # cpu: a CPU generator, then moved
                        generator=g).permute(
            *reversed(range(len(shape))))          # cpu: a CPU generator, then moved
    else:
        x = torch.randn(*shape, generator=g)       # cpu: a CPU generator, then moved
    return x.to(initialize.get_device())


def run_mappings_case(learners: Tuple[Callable, ...], case: Case) -> Outcome:
    """Runs on every rank: each of the learner's operators (in ``case.params["names"]``
    order) on this rank's ``x``, forward and backward, against the mirror's (module
    docstring)."""
    p = case.params
    for i, (name, fn) in enumerate(zip(p["names"], learners)):
        fwd, bwd = SPEC[name]
        where = getattr(fn, "__name__", f"my_{name}")
        x = _rank_tensor(p["x"], p["seed"] + 10 * i, p.get("strided", False))
        x_ref = x.detach().clone().requires_grad_()
        y_ref = getattr(mappings, name)(x_ref)
        candidates = _candidates(x)
        x_mine = x.detach().clone().requires_grad_()     # clone keeps x's strides
        with C10dCalls() as calls:
            y = fn(x_mine)
        seen = _verdict(f"{where}(x), forward", fwd, y, y_ref, candidates,
                        calls.collectives(), fwd.startswith("block"))
        if seen.ok and not y.requires_grad:
            seen = Outcome(False, f"{where}(x), forward", "a tensor autograd can "
                           "differentiate (apply an autograd Function)",
                           "no gradient: the output does not depend on x through autograd")
        if not on_every_rank(seen.ok):
            return seen if not seen.ok else Outcome(True)
        dy = _rank_tensor(list(y_ref.shape), p["seed"] + 10 * i + 5, p.get("strided", False))
        (dx_ref,) = torch.autograd.grad(y_ref, x_ref, dy)
        candidates = _candidates(dy)
        with C10dCalls() as calls:
            (dx,) = torch.autograd.grad(y, x_mine, dy, allow_unused=True)
        seen = _verdict(f"{where}(x), backward: dL/dX for the case's dL/dY", bwd, dx, dx_ref,
                        candidates, calls.collectives(), bwd.startswith("block"))
        if not on_every_rank(seen.ok):
            return seen if not seen.ok else Outcome(True)
    return Outcome(True)


TP_NAMES = tuple(SPEC)[:4]
SP_NAMES = tuple(SPEC)[4:]


def _cases(names: Sequence[str], seed: int) -> List[Case]:
    return [Case("x [4, 2, 6]", dict(names=list(names), x=[4, 2, 6], seed=seed)),
            Case("x [2, 3, 4], a strided view (the transpose of a [4, 3, 2] tensor)",
                 dict(names=list(names), x=[2, 3, 4], seed=seed + 1, strided=True)),
            Case("x [6, 1, 2]", dict(names=list(names), x=[6, 1, 2], seed=seed + 2))]


TP_MAPPINGS = Exercise(
    name="my_tensor_parallel_mappings",
    run_case=run_mappings_case,
    cases=_cases(TP_NAMES, 1),
    hint=("each function applies an autograd Function (define it inside the function: a class "
          "typed in a notebook does not travel to the ranks) whose forward and backward are "
          "the two columns of the table, over parallel_state.get_tensor_model_parallel_group() "
          "(never the whole world). The blocks are along the LAST dimension; a block is "
          "made .contiguous(); the all-gather concatenates the group's blocks in rank order."),
    parts=tuple(f"my_{n}" for n in TP_NAMES),
    ranks_needed=two_tp_ranks,
    layout=tp_pairs,
    module="mappings.py",
    saves_as=TP_NAMES,
)

SP_MAPPINGS = Exercise(
    name="my_sequence_parallel_mappings",
    run_case=run_mappings_case,
    cases=_cases(SP_NAMES, 11),
    hint=("as the tensor-parallel four, but along dim 0, the sequence of [s, b, h]: the "
          "gather's backward sums the group's partial gradients and keeps this rank's block "
          "(a reduce-scatter: dist.reduce_scatter_tensor, or an all-reduce and the block), and "
          "the reduce-scatter's backward is the all-gather; always over "
          "parallel_state.get_tensor_model_parallel_group()."),
    parts=tuple(f"my_{n}" for n in SP_NAMES),
    ranks_needed=two_tp_ranks,
    layout=tp_pairs,
    module="mappings.py",
    saves_as=SP_NAMES,
)
