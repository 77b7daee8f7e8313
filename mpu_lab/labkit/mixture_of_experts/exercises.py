"""Lab 13's checks and its write-the-code exercise.

Checks (the expected value computed by mpu_lab: the cost model, the router's capacity, the
rank groups): :func:`check_moe_scaling` (parameters and FLOPs per token as E grows),
:func:`check_capacity` (Switch's expert capacity), :func:`check_expert_ranks` (on how many
ranks one expert lives), :func:`check_expert_data_parallel_size` (how many copies of each
expert a layout keeps).

The write-the-code exercise, :data:`DISPATCH`: the all-to-all token dispatcher's
permutation and its count exchange, run with real all-to-alls on a live world.

The learner writes ``my_dispatch(tokens, routing_map, group)``: this rank's tokens ``[T, h]``
and its router's choices ``[T, E]`` (bool) in, the rows this rank's experts receive out, in
the order Megatron-core's ``MoEAlltoAllTokenDispatcher`` hands them to its experts (grouped by
local expert, then by source rank, each source's rows in token order), with the number of
rows of each local expert. The ``E`` experts are spread over the ranks of ``group`` as
Megatron does: rank ``r`` holds experts ``r*E/ep .. (r+1)*E/ep - 1``.

Each case sets up Megatron's expert groups for its ``ep`` on the grading world (so ``group``
is the expert-model-parallel group of :mod:`mpu_lab.core.parallel_state`) and compares with the
mirror's own dispatcher (:class:`mpu_lab.core.transformer.moe.MoEAlltoAllTokenDispatcher`), which the
package tests hold against a single-process MoE. Token rows carry their name: row ``t`` of
rank ``r`` is ``[100 r + t, 100 r + t + 0.5]``, so a verdict lists the rows by name.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state
from mpu_lab.labkit.verdict import Verdict, as_floats, as_int, unanswered, verdict
from mpu_lab.labkit.grader import Case, Exercise, Outcome
from mpu_lab.labkit.notebooks import leaks
from mpu_lab.core.transformer.moe import MoEAlltoAllTokenDispatcher, get_capacity
from mpu_lab.core.parallel_state import generate_rank_groups
from mpu_lab.perf.cost_model.moe import (MIXTRAL_8X7B, MoEModelShape, moe_flops_per_token,
                                         moe_parameter_count)


# --------------------------------------------------------------------------- checks
def _with_experts(model: MoEModelShape, num_experts: int) -> MoEModelShape:
    return MoEModelShape(**{**model.__dict__, "num_experts": num_experts})


def check_moe_scaling(answer, from_experts: int = 8, to_experts: int = 64,
                      model: MoEModelShape = MIXTRAL_8X7B) -> Verdict:
    """``answer = (parameter factor, FLOPs-per-token factor)`` when ``model`` (top-k fixed)
    goes from ``from_experts`` to ``to_experts`` experts per layer; right within 10 %."""
    if unanswered(answer, "a pair (parameter factor, FLOPs-per-token factor)"):
        return Verdict(False)
    given = as_floats(answer)
    small, large = _with_experts(model, from_experts), _with_experts(model, to_experts)
    params = moe_parameter_count(large)["total"] / moe_parameter_count(small)["total"]
    flops = moe_flops_per_token(large)["total"] / moe_flops_per_token(small)["total"]
    if given is None or len(given) != 2:
        print(f"Not yet: {answer!r} is not a pair of numbers (parameters, FLOPs per token).")
        return Verdict(False)
    ok = [abs(g - e) <= 0.1 * e for g, e in zip(given, (params, flops))]
    return verdict(all(ok),
                   f"the parameters grow {params:.1f}x (the experts are almost all of them), "
                   f"the FLOPs per token {flops:.2f}x (a token still meets {model.k} experts).",
                   "not quite. Hint: which part of the model grows with the number of experts, "
                   "and how many experts does one token run through?")


def check_capacity(answer, num_tokens: int, num_experts: int, topk: int,
                   capacity_factor: float) -> Verdict:
    """The expert capacity (Switch Transformers §2.2, Megatron's ``get_capacity``)."""
    if unanswered(answer, "a number of tokens"):
        return Verdict(False)
    expected = get_capacity(num_tokens * topk, num_experts, capacity_factor)
    return verdict(as_int(answer) == expected,
                   f"{expected} (token, expert) pairs per expert.",
                   f"{answer!r} is not it. Hint: the capacity is the fair share of the routed "
                   f"(token, expert) pairs, times the factor, rounded up.")


def check_expert_data_parallel_size(answer, world_size: int, tp: int, pp: int, ep: int) -> Verdict:
    """How many ranks hold the same experts (Megatron's expert data-parallel size) with
    expert-tensor-parallel size = ``tp``."""
    if unanswered(answer, "a number of ranks"):
        return Verdict(False)
    groups = generate_rank_groups(world_size, tp, pp, expert_model_parallel_size=ep)
    expected = len(groups["expert-dp"][0])
    return verdict(as_int(answer) == expected,
                   f"{expected}: each expert lives on {expected} ranks, which average its "
                   f"gradients (e.g. {groups['expert-dp'][0]}).",
                   f"{answer!r} is not it. Hint: a pipeline stage has world / p ranks; "
                   f"t of them split one expert, ep of those groups split the experts.")


def check_expert_ranks(answer, world_size: int, tp: int, pp: int, ep: int) -> Verdict:
    """On how many ranks one expert lives with expert-tensor-parallel size ``etp = tp``
    (Megatron's default): ``etp`` ranks split it, and each of its shards is copied on the
    expert data-parallel size of ranks, so ``etp x edp`` in all (megatron/core/parallel_state.py,
    the expert ``RankGenerator``)."""
    if unanswered(answer, "a number of ranks"):
        return Verdict(False)
    groups = generate_rank_groups(world_size, tp, pp, expert_model_parallel_size=ep)
    etp, edp = len(groups["expert-tp"][0]), len(groups["expert-dp"][0])
    expected = etp * edp
    return verdict(as_int(answer) == expected,
                   f"{expected}: etp = {etp} ranks split each expert, and each shard is copied "
                   f"on edp = {edp} ranks, which average its gradients (e.g. expert-dp group "
                   f"{groups['expert-dp'][0]}).",
                   f"{answer!r} is not it. Hint: a pipeline stage has world / p ranks; etp = t "
                   f"of them split one expert, ep of those groups split the experts, and the "
                   f"rest hold copies.")


def case_inputs(rank: int, num_tokens: int, num_experts: int, topk: int, seed: int,
                skew: bool = False, device=None):
    """Rank ``rank``'s ``(tokens [T, 2], routing_map [T, E])`` for a case: row ``t`` is
    ``[100 rank + t, 100 rank + t + 0.5]``; the routing is the top ``topk`` of random logits
    drawn from ``seed`` and the rank. ``skew``: rank 0's tokens all choose among the first
    ``topk`` experts (so rank 0 sends some peers nothing: a split size of zero)."""
    ids = 100.0 * rank + torch.arange(num_tokens, dtype=torch.float32)  # cpu: a CPU generator; moved below
    tokens = torch.stack([ids, ids + 0.5], dim=1)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    logits = torch.randn(num_tokens, num_experts, generator=gen)  # cpu: a CPU generator; moved below
    if skew and rank == 0:
        logits[:, :topk] += 100.0
    top = logits.topk(topk, dim=1).indices
    routing_map = torch.zeros(num_tokens, num_experts,  # cpu: beside the CPU logits; moved below
                              dtype=torch.bool).scatter(1, top, True)
    return tokens.to(device), routing_map.to(device)


def reference_dispatch(tokens: torch.Tensor, routing_map: torch.Tensor):
    """What Megatron's dispatcher gives this rank's experts: ``(rows, tokens_per_local_expert)``
    from the mirror's :class:`~mpu_lab.core.transformer.moe.MoEAlltoAllTokenDispatcher` over the
    expert-model-parallel group (expert-tensor-parallel size 1)."""
    ep = parallel_state.get_expert_model_parallel_world_size()
    num_experts = routing_map.size(1)
    local = num_experts // ep
    first = parallel_state.get_expert_model_parallel_rank() * local
    dispatcher = MoEAlltoAllTokenDispatcher(local, list(range(first, first + local)),
                                            SimpleNamespace(num_moe_experts=num_experts))
    probs = routing_map.float()
    rows, probs = dispatcher.dispatch_preprocess(tokens, routing_map, probs)
    rows, probs = dispatcher.token_dispatch(rows, probs)
    rows, counts, _ = dispatcher.dispatch_postprocess(rows, probs)
    return rows, [int(c) for c in counts]


def split_mismatches(everyone) -> List[str]:
    """What is wrong with the split sizes of one ``all_to_all_single`` over a group, given each
    group rank's ``(input_split_sizes, output_split_sizes, input_rows, output_rows)`` (None
    splits: equal shares): a rank whose splits do not add up to its rows, or a pair of ranks
    that disagree on how many rows go from one to the other. ``[]`` when they agree."""
    n, problems = len(everyone), []
    full = []
    for r, (ins, outs, in_rows, out_rows) in enumerate(everyone):
        ins = list(ins) if ins is not None else [in_rows // n] * n
        outs = list(outs) if outs is not None else [out_rows // n] * n
        for what, splits, rows in (("input", ins, in_rows), ("output", outs, out_rows)):
            if len(splits) != n or sum(splits) != rows:
                problems.append(f"group rank {r}'s {what}_split_sizes {splits} do not cut its "
                                f"{rows} {what} rows into {n} blocks")
        full.append((ins, outs))
    if problems:
        return problems
    for src in range(n):
        for dst in range(n):
            sent, expected = full[src][0][dst], full[dst][1][src]
            if sent != expected:
                problems.append(f"group rank {src} sends group rank {dst} {sent} rows, but "
                                f"group rank {dst} expects {expected}")
    return problems


class _SplitCheck(TorchDispatchMode):
    """Sees each c10d all-to-all (``c10d.alltoall_base_``: ``all_to_all_single`` however it is
    called) before it runs, and compares the split sizes of every rank of its group."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(getattr(func, "_overloadpacket", "")) == "c10d.alltoall_base_":
            output, input_, group, output_split_sizes, input_split_sizes = args[:5]
            group = dist.ProcessGroup.unbox(group)
            mine = ([int(v) for v in input_split_sizes] or None,     # []: equal splits
                    [int(v) for v in output_split_sizes] or None,
                    int(input_.size(0)) if input_.dim() else 1,
                    int(output.size(0)) if output.dim() else 1)
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, mine, group=group)    # not seen: the mode is off
            problems = split_mismatches(everyone)
            if problems:
                raise ValueError("all_to_all_single's split sizes disagree: "
                                 + "; ".join(problems[:3]))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def checked_all_to_all():
    """While inside, every ``all_to_all_single`` first compares every rank's split sizes (one
    ``all_gather_object`` over the group) and, where they disagree, raises the same
    ``ValueError`` on every rank, naming the ranks and the counts. Without it a learner's
    mismatched splits can kill a gloo rank outright. From outside, with a dispatch mode that
    sees the c10d op (nothing in ``torch.distributed`` is replaced)."""
    with _SplitCheck():
        yield


def _names(rows) -> str:
    """Rows as their names (the first column), e.g. ``[0, 3, 101]``, at most 16 of them."""
    if not hasattr(rows, "shape") or rows.dim() != 2 or rows.size(1) != 2:
        return f"{type(rows).__name__} of shape {tuple(getattr(rows, 'shape', ()))}"
    names = [f"{v:g}" for v in rows[:, 0].detach().float().cpu().tolist()]
    return "[" + ", ".join(names[:16]) + (", ..." if len(names) > 16 else "") + "]"


def run_dispatch_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank: Megatron's expert groups for the case's ``ep`` (``"world"``: every
    rank), the case's tokens through the learner's ``my_dispatch`` and through the mirror's
    dispatcher, then the counts and the rows compared."""
    p = case.params
    world = torch.distributed.get_world_size()
    ep = world if p["ep"] == "world" else p["ep"]
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    num_experts = p["experts_per_rank"] * ep
    rank = torch.distributed.get_rank()
    tokens, routing_map = case_inputs(rank, p["tokens"], num_experts, p["topk"], p["seed"],
                                      p.get("skew", False), initialize.get_device())
    expected, expected_counts = reference_dispatch(tokens, routing_map)
    where = (f"ep rank {parallel_state.get_expert_model_parallel_rank()} of {ep} "
             f"(experts {parallel_state.get_expert_model_parallel_rank() * p['experts_per_rank']}"
             f"..{(parallel_state.get_expert_model_parallel_rank() + 1) * p['experts_per_rank'] - 1}):")
    with checked_all_to_all():
        got = learner(tokens.clone(), routing_map.clone(),
                      parallel_state.get_expert_model_parallel_group())
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return Outcome(False, f"{where} what my_dispatch returned",
                       "a pair (rows, tokens_per_local_expert)", f"{type(got).__name__} {got!r:.60}")
    rows, counts = got
    counts = [int(c) for c in counts.tolist()] if hasattr(counts, "tolist") else counts
    try:
        counts = [int(c) for c in counts]
    except (TypeError, ValueError):
        return Outcome(False, f"{where} tokens_per_local_expert", str(expected_counts), repr(counts))
    if counts != expected_counts:
        return Outcome(False, f"{where} tokens_per_local_expert", str(expected_counts), str(counts))
    if not hasattr(rows, "shape") or tuple(rows.shape) != tuple(expected.shape):
        return Outcome(False, f"{where} rows received (shape)", f"shape {tuple(expected.shape)}",
                       f"shape {tuple(getattr(rows, 'shape', ()))}")
    if not torch.equal(rows.detach().float().cpu(), expected.detach().float().cpu()):
        return Outcome(False, f"{where} rows received, by name (100 x source rank + token)",
                       _names(expected), _names(rows))
    return Outcome(True)


def _even_world(world_size: int, tp: int, pp: int) -> Optional[str]:
    if world_size < 2 or world_size % 2:
        return f"it needs an even number of ranks (2 or more), this world has {world_size}"
    return None


def _dense_only(world_size: int):
    """The grading layout: tensor and pipeline sizes 1 (each case adds its expert groups)."""
    return 1, 1


DISPATCH = Exercise(
    name="my_dispatch",
    module="token_dispatcher.py",       # saved into the learner's package once right
    run_case=run_dispatch_case,
    cases=[
        Case("ep = 2, top-1, 2 experts per rank",
             dict(ep=2, experts_per_rank=2, topk=1, tokens=6, seed=1)),
        Case("ep = every rank, top-2, 2 experts per rank",
             dict(ep="world", experts_per_rank=2, topk=2, tokens=5, seed=2)),
        Case("ep = every rank, rank 0 sends some ranks nothing",
             dict(ep="world", experts_per_rank=1, topk=1, tokens=4, seed=3, skew=True)),
        Case("ep = 2, top-3, 3 experts per rank",
             dict(ep=2, experts_per_rank=3, topk=3, tokens=3, seed=4)),
    ],
    hint="a receiver cannot post its all-to-all before it knows how many rows each peer will "
         "send it, and only the senders know that; and the rows arrive grouped the way the "
         "senders sent them, not the way your experts want them.",
    ranks_needed=_even_world,
    layout=_dense_only)

__all__: List[str] = ["check_moe_scaling", "check_capacity", "check_expert_data_parallel_size",
                       "check_expert_ranks",
                       "DISPATCH", "case_inputs", "checked_all_to_all", "split_mismatches", "reference_dispatch", "run_dispatch_case"]


# --------------------------------------------------------------------------- answers
# What lab 13's graded questions answer, for the leak check (mpu_lab.labkit.notebooks.leaks),
# computed as the checks compute them, at the arguments the lab passes.
def _scaling(from_experts: int, to_experts: int, model: MoEModelShape = MIXTRAL_8X7B):
    small, large = _with_experts(model, from_experts), _with_experts(model, to_experts)
    return (moe_parameter_count(large)["total"] / moe_parameter_count(small)["total"],
            moe_flops_per_token(large)["total"] / moe_flops_per_token(small)["total"])


def _expert_ranks(world_size: int, tp: int, pp: int, ep: int) -> int:
    groups = generate_rank_groups(world_size, tp, pp, expert_model_parallel_size=ep)
    return len(groups["expert-tp"][0]) * len(groups["expert-dp"][0])


_PARAMS_8_TO_64, _FLOPS_8_TO_64 = _scaling(8, 64)
leaks.declare_answers([
    ("13", "moe scaling 8 -> 64", [(round(_PARAMS_8_TO_64, 1), round(_FLOPS_8_TO_64, 2)),
                                   f"{_PARAMS_8_TO_64:.1f}x", f"{_FLOPS_8_TO_64:.2f}x"],
     "check_moe_scaling("),
    ("13", "capacity", [get_capacity(32 * 1, 4, 1.0),
                        f"{get_capacity(32 * 1, 4, 1.0)} tokens per expert"], "check_capacity("),
    ("13", "expert ranks", [_expert_ranks(16, 2, 2, 2),
                            f"{_expert_ranks(16, 2, 2, 2)} ranks"], "check_expert_ranks("),
])
