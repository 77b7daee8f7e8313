"""Lab 05's checks and its write-the-code exercise.

* :func:`check_bytes_per_parameter` — the bytes per parameter a rank keeps under each of
  Megatron-FSDP's four strategies (fp32 Adam, ``d`` ranks), against ZeRO's stages
  (:func:`mpu_lab.perf.cost_model.fsdp.resident_bytes_per_rank`, one parameter);
* :func:`check_bytes_per_step` — what one rank moves per step under ``no_shard`` and
  ``optim_grads_params``, in multiples of the gradient bytes Ψ
  (:func:`mpu_lab.perf.cost_model.fsdp.data_parallel_bytes_per_step`);
* :data:`FSDP_UNIT` — the learner builds an FSDP unit (``my_fully_shard``: the hooks that
  all-gather the shard before forward, free it after, gather again for backward and
  reduce-scatter the gradients; ``my_sharded_step``: SGD on the shard), graded on a live world
  against plain data parallelism (a dense single-process reference on the whole batch): the
  values, the collectives issued (seen from outside, :mod:`mpu_lab.labkit.c10d_calls`), and
  the memory freed.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

from mpu_lab.core import parallel_state
from mpu_lab.labkit.c10d_calls import C10dCall, C10dCalls
from mpu_lab.labkit.grader import Case, Exercise, Outcome, compare
from mpu_lab.labkit.notebooks.leaks import declare_answers
from mpu_lab.labkit.sharded_data_parallel import fsdp_unit
from mpu_lab.labkit.verdict import EMPTY, Verdict, unanswered, verdict
from mpu_lab.perf.cost_model import fsdp as fsdp_model
from mpu_lab.training import initialize

STRATEGIES = fsdp_model.DATA_PARALLEL_SHARDING_STRATEGIES


# --------------------------------------------------------------------------- predictions
def bytes_per_parameter(d: int) -> Dict[str, float]:
    """Bytes per parameter a rank keeps under each strategy at data-parallel size ``d``: fp32
    weight and gradient (4 + 4) and Adam's two fp32 moments (8), each whole or ``/ d``."""
    return {s: sum(fsdp_model.resident_bytes_per_rank(s, 1, d).values()) for s in STRATEGIES}


def _number(v: Any):
    if isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def check_bytes_per_parameter(answer: Any, d: int = 4, rtol: float = 1e-3) -> Verdict:
    """``answer``: ``{strategy: bytes per parameter per rank}`` for the four strategies."""
    if unanswered(answer, "a dict {strategy: bytes per parameter per rank}"):
        return Verdict(False)
    if not isinstance(answer, dict) or set(answer) != set(STRATEGIES):
        got = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
        print(f"{EMPTY} give a dict with the keys {list(STRATEGIES)}; got {got}.")
        return Verdict(False)
    expected = bytes_per_parameter(d)
    wrong = [s for s in STRATEGIES if _number(answer[s]) is None
             or abs(_number(answer[s]) - expected[s]) > rtol * expected[s]]
    terms = {s: fsdp_model.resident_bytes_per_rank(s, 1, d) for s in STRATEGIES}
    text = "; ".join(f"{s} {terms[s]['param_bytes']:g} + {terms[s]['grad_bytes']:g} + "
                     f"{terms[s]['optimizer_state_bytes']:g} = {expected[s]:g}"
                     for s in STRATEGIES)
    return verdict(not wrong, f"weight + gradient + Adam's moments per rank: {text}.",
                   f"{', '.join(wrong)} not yet. Hint: fp32 weight 4, gradient 4, Adam's m and "
                   f"v 8 bytes; ZeRO's stages divide by d = {d}, in turn, the optimizer states, "
                   f"the gradients, the weights.")


def check_bytes_per_step(answer: Any, d: int = 4, rtol: float = 1e-3) -> Verdict:
    """``answer``: ``{"no_shard": x, "optim_grads_params": y}``, bytes one rank sends per step
    in multiples of the fp32 gradients' bytes, 4Ψ (ring collectives)."""
    keys = ("no_shard", "optim_grads_params")
    if unanswered(answer, "{'no_shard': x, 'optim_grads_params': y} (multiples of 4Ψ bytes)"):
        return Verdict(False)
    if not isinstance(answer, dict) or set(answer) != set(keys):
        print(f"{EMPTY} give a dict with the keys {list(keys)}.")
        return Verdict(False)
    expected = {k: fsdp_model.data_parallel_bytes_per_step(k, 1.0, d) for k in keys}
    wrong = [k for k in keys if _number(answer[k]) is None
             or abs(_number(answer[k]) - expected[k]) > rtol * expected[k]]
    return verdict(not wrong,
                   f"no_shard's all-reduce 2(d-1)/d = {expected['no_shard']:g} x 4Ψ bytes; ZeRO-3's two "
                   f"all-gathers and one reduce-scatter 3(d-1)/d = "
                   f"{expected['optim_grads_params']:g} x 4Ψ bytes: "
                   f"{expected['optim_grads_params'] / expected['no_shard']:g} x.",
                   f"{', '.join(wrong)} not yet. Hint: a ring all-reduce sends 2(d-1)/d of the "
                   f"array per rank, a reduce-scatter or an all-gather (d-1)/d of the whole "
                   f"array; how many of each does a ZeRO-3 step need?")


# --------------------------------------------------------------------------- write the code
# The learner writes ``my_fully_shard(unit)`` (registers hooks on unit.module and its
# parameters; unit is an FsdpUnit, started sharded) and ``my_sharded_step(unit, lr)`` (SGD on
# unit.shard with unit.shard_grad). The grader trains a few units with them on every rank's
# own data, watching the collectives and the whole parameters between the phases.
def _phase_log(phase: List[str], log: Dict[str, List[str]]) -> Callable[[C10dCall], None]:
    def note(call: C10dCall) -> None:
        log.setdefault(phase[0], []).append(call.what)
    return note


def run_fsdp_unit_case(learner, case: Case) -> Outcome:
    """Runs on every rank: ``steps`` SGD steps of the units with the learner's FSDP, against
    the dense reference on the whole global batch."""
    fully_shard, sharded_step = learner
    group = parallel_state.get_data_parallel_group()
    d, me = dist.get_world_size(group=group), dist.get_rank(group=group)
    sizes, steps, lr, seed = (case.params[k] for k in ("sizes", "steps", "lr", "seed"))
    device = initialize.get_device()
    where = f"data-parallel rank {me} of {d}:"
    data = fsdp_unit.batches(sizes, d, 3, steps, seed + 1, device)
    ref_grads, ref_params = fsdp_unit.reference_shards(sizes, data, lr, seed, d, me, device)
    model = fsdp_unit.blocks(sizes, seed, device)
    units = [fsdp_unit.FsdpUnit(m, group, d, me) for m in model]
    for unit in units:
        fully_shard(unit)
    L = len(units)
    for step, batch in enumerate(data):
        x, y = batch[me]
        for unit in units:
            unit.shard_grad.zero_()
        phase, log = ["forward"], {}
        with C10dCalls(on_call=_phase_log(phase, log)):
            try:
                loss = torch.nn.functional.mse_loss(model(x), y)
            except RuntimeError as exc:
                return Outcome(False, f"{where} step {step + 1}, forward",
                               "each unit's whole parameters installed before its forward "
                               "(all-gather the shard in a forward pre-hook, then "
                               "unit.install)", _first_line(exc))
            whole = [i for i, u in enumerate(units) if u.is_whole()]
            if whole:
                return Outcome(False, f"{where} step {step + 1}, the memory after forward",
                               "every unit's whole parameters freed (p.data = an empty "
                               "tensor, in a forward hook)",
                               f"unit(s) {whole} still hold their whole parameters")
            alive = [i for i, u in enumerate(units) if u.gathered_alive()]
            if alive:
                return Outcome(False, f"{where} step {step + 1}, the memory after forward",
                               "no gathered buffer alive after forward",
                               f"unit(s) {alive} keep the all-gathered buffer referenced")
            phase[0] = "backward"
            try:
                loss.backward()
            except RuntimeError as exc:
                return Outcome(False, f"{where} step {step + 1}, backward",
                               "each unit gathered again before its backward (a hook on the "
                               "gradient of the unit's output)", _first_line(exc))
        out = _collectives_outcome(log, L, where, step)
        if not out.ok:
            return out
        left = [i for i, u in enumerate(units) if u.is_whole() or u.gathered_alive()]
        if left:
            return Outcome(False, f"{where} step {step + 1}, the memory after backward",
                           "every unit's whole parameters freed once its gradients are "
                           "reduce-scattered", f"unit(s) {left} still hold them")
        grads = [i for i, u in enumerate(units) if any(p.grad is not None for p in u.params)]
        if grads:
            return Outcome(False, f"{where} step {step + 1}, the memory after backward",
                           "no whole gradient left (.grad) once reduce-scattered "
                           "(unit.flat_grads() drops them)", f"unit(s) {grads} keep .grad")
        for i, unit in enumerate(units):
            expected = ref_grads[step][i]
            out = compare(f"{where} step {step + 1}, unit {i}'s shard_grad (this rank's shard "
                          f"of the averaged gradient)", expected, unit.shard_grad)
            if not out.ok:
                if torch.allclose(unit.shard_grad, d * expected, atol=1e-6, rtol=1e-5):
                    out.got += f": {d} x the average (the sum over the {d} ranks)"
                return out
        with C10dCalls() as calls:
            for unit in units:
                sharded_step(unit, lr)
        if calls.collectives():
            return Outcome(False, f"{where} step {step + 1}, my_sharded_step's collectives",
                           "none: a rank steps its own shard with its own shard of the "
                           "gradient", ", ".join(calls.collectives()))
    for i, unit in enumerate(units):
        out = compare(f"{where} unit {i}'s parameter shard after {steps} step(s)",
                      ref_params[i], unit.shard)
        if not out.ok:
            return out
    return Outcome(True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def _collectives_outcome(log: Dict[str, List[str]], L: int, where: str, step: int) -> Outcome:
    """One all-gather per unit in forward; one all-gather and one reduce-scatter per unit in
    backward; no all-reduce."""
    fwd, bwd = log.get("forward", []), log.get("backward", [])
    expected = (f"forward: {L} all-gather(s) (one per unit); backward: {L} all-gather(s) and "
                f"{L} reduce-scatter(s); no all-reduce")
    got = f"forward: {_count(fwd)}; backward: {_count(bwd)}"
    what = f"{where} step {step + 1}, the collectives issued"
    if "all-reduce" in fwd + bwd:
        return Outcome(False, what + " (an all-reduce leaves every rank the whole gradient: "
                       "reduce-scatter, so each keeps its 1/d)", expected, got)
    if fwd.count("all-gather") != L or set(fwd) - {"all-gather"}:
        return Outcome(False, what, expected, got)
    if bwd.count("reduce-scatter") != L:
        return Outcome(False, what + " (one reduce-scatter per unit, once every parameter of "
                       "the unit has its gradient)", expected, got)
    if bwd.count("all-gather") != L:
        return Outcome(False, what + " (each unit is gathered again before its backward)",
                       expected, got)
    return Outcome(True)


def _count(calls: List[str]) -> str:
    if not calls:
        return "none"
    kinds = sorted(set(calls))
    return ", ".join(f"{calls.count(k)} {k}" for k in kinds)


FSDP_UNIT = Exercise(
    name="my_fully_shard, my_sharded_step",
    run_case=run_fsdp_unit_case,
    cases=[
        Case("one unit 4 -> 4, 1 step", dict(sizes=[4, 4], steps=1, lr=0.1, seed=1)),
        Case("three units 6 -> 5 -> 5 -> 3 (padding), 2 steps",
             dict(sizes=[6, 5, 5, 3], steps=2, lr=0.1, seed=2)),
        Case("two units 8 -> 8 -> 2, 3 steps, lr 0.05",
             dict(sizes=[8, 8, 2], steps=3, lr=0.05, seed=3)),
    ],
    hint="before a unit's forward: all-gather unit.shard over unit.group into the whole "
         "buffer and unit.install it; after its forward: free each p.data and hook the "
         "output's gradient to gather again; when every parameter of the unit has its "
         "gradient: reduce-scatter unit.flat_grads(), divide by unit.d into unit.shard_grad, "
         "free the whole parameters. The step updates unit.shard only.",
    parts=("my_fully_shard", "my_sharded_step"),
    module="fsdp.py",
)


# Lab 05's graded answers at the notebook's d = 4 (tests/labs/test_no_answer_before_commit.py
# searches the notebook for them above each answer cell: mpu_lab.labkit.notebooks.leaks).
_PER_PARAMETER = tuple(bytes_per_parameter(4).values())          # (16, 10, 7, 4)
declare_answers([
    ("05", "bytes per parameter per strategy at d = 4",
     [_PER_PARAMETER, "16, 10, 7, 4", "16 bytes", "10 bytes", "7 bytes"],
     "check_bytes_per_parameter("),
    ("05", "bytes per step, no_shard and optim_grads_params, multiples of 4Ψ at d = 4",
     [(1.5, 2.25), 2.25, "1.5 x", "2.25 Ψ"], "check_bytes_per_step("),
])
