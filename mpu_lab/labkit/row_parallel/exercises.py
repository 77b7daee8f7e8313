"""Lab 07's checks: a row-parallel weight's shape, the all-reduces of a tensor-parallel MLP, and
the write-the-code exercise :data:`ROW_FORWARD` (the row-parallel forward, graded on a live
world)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state
from mpu_lab.labkit.verdict import (
    Verdict,
    as_int_list,
    check_tensor,
    tp_group_of,
    unanswered,
    verdict,
)
from mpu_lab.labkit.grader import Case, Exercise, Outcome, compare, show
from mpu_lab.labkit.notebooks.leaks import declare_answers
from mpu_lab.labkit import profiles
from mpu_lab.core.tensor_parallel.layers import RowParallelLinear
from mpu_lab.labkit.column_parallel.viz import shard_shapes


def check_row_weight_shape(answer: Any, input_size: int, output_size: int, tp: int) -> Verdict:
    """Shape of one rank's ``RowParallelLinear(input_size, output_size).weight`` at ``tp``."""
    if unanswered(answer, "a shape such as (rows, cols)"):
        return Verdict(False)
    (rows, cols) = shard_shapes("row", input_size, output_size, tp)[0]  # A_i: [in/t, out]
    expected = (cols, rows)
    given = as_int_list(answer)
    right = (f"each rank stores weight {expected}: A_i = [{rows}, {cols}] transposed, the rows "
             f"of A cut by the tensor-parallel size {tp}.")
    if given is not None and tuple(given) == (rows, cols) and rows != cols:
        return verdict(False, right, f"{(rows, cols)} is A_i = [in/t, out]; the Parameter "
                                     f"stores W_i = A_i^T because F.linear computes X W^T.")
    return verdict(given is not None and tuple(given) == expected, right,
                    f"{answer!r} is not it. Hint: the rows of A (input_size) are cut into t "
                    f"pieces, and the weight is stored as [out, in/t].")


# Collectives of one tensor-parallel MLP, Column(gather_output=False) -> Row(input_is_parallel=True):
# forward: f is the identity, g all-reduces once; backward: g is the identity, f all-reduces once.
MLP_ALL_REDUCES = {"forward": 1, "backward": 1}


def check_mlp_all_reduces(answer: Any) -> Verdict:
    """All-reduces of one tensor-parallel MLP (Megatron-LM §3): ``(forward, backward)``."""
    if unanswered(answer, "a pair (forward, backward) of counts"):
        return Verdict(False)
    given = as_int_list(answer)
    expected = [MLP_ALL_REDUCES["forward"], MLP_ALL_REDUCES["backward"]]
    return verdict(given == expected,
                    "one all-reduce forward (g after the row-parallel layer) and one backward "
                    "(f before the column-parallel layer).",
                    f"{answer!r} is not it. Hint: with gather_output=False and "
                    f"input_is_parallel=True nothing is gathered or scattered; only f and g "
                    f"communicate, each in one direction.")



# --------------------------------------------------------------------------- write the code
# The learner writes the row-parallel forward, Y = X A + b with A cut by rows (Megatron-LM,
# Shoeybi et al. 2019, §3, Fig. 3: the row-parallel half of the MLP and its operator g). Graded
# on every rank against mpu_lab's RowParallelLinear built from the same master weight, forward
# output and input gradient. Each data-parallel replica gets its own X (as in training), so a
# sum over the whole world instead of the tensor-parallel group shows whenever dp > 1.
ROW_FORWARD_NAME = "my_row_forward(x, weight, bias, input_is_parallel)"
ROW_FORWARD_HINT = (
    "when input_is_parallel is False, keep this rank's block of x's last dimension with a split "
    "whose backward all-gathers the gradient (scatter_to_tensor_model_parallel_region); "
    "multiply by the shard; sum the partial results over the tensor-parallel group only, not "
    "the whole world (g); then add the bias once, after the sum.")


def _fill(master: torch.Tensor, weight: torch.Tensor) -> None:
    """An ``init_method`` that writes ``master`` (the full ``[out, in]`` weight) into ``weight``."""
    with torch.no_grad():
        weight.copy_(master)


def _row_sizes(params: Dict[str, Any], tp: int) -> Tuple[int, int]:
    """A case's ``(input_size, output_size)``: ``input_size``, or ``input_per_rank`` times t."""
    return params.get("input_size") or params["input_per_rank"] * tp, params["output_size"]


def row_inputs(params: Dict[str, Any], tp: int, tp_rank: int, dp_rank: int):
    """CPU tensors of one case: the master weight [out, in] and bias [out] (the same on every
    rank), this replica's X (the whole [..., in], or this rank's block of it) and dL/dY."""
    input_size, output_size = _row_sizes(params, tp)
    # Drawn from CPU generators, so every rank and device gets the same numbers; the caller
    # moves them to the rank's device.
    common = torch.Generator().manual_seed(params["seed"])
    master = torch.randn(output_size, input_size, generator=common,
                         device="cpu") / input_size ** 0.5  # cpu: CPU generator
    bias = 1.0 + torch.rand(output_size, generator=common, device="cpu")  # cpu: in [1, 2)
    mine = torch.Generator().manual_seed(params["seed"] + 1000 * (dp_rank + 1))   # per replica
    x = torch.randn(*params["batch"], input_size, generator=mine, device="cpu")  # cpu: as above
    grad_y = torch.randn(*params["batch"], output_size, generator=mine,
                         device="cpu")  # cpu: CPU generator
    if params["input_is_parallel"]:
        x = x.chunk(tp, dim=-1)[tp_rank]
    return master, (bias if params["bias"] else None), x, grad_y


def _diagnosis(got, expected, local, bias, tp: int, world_sum) -> str:
    """Name a classic slip when ``got`` is exactly what it produces ("" when none matches)."""
    def same(a) -> bool:
        return (a is not None and a.shape == got.shape and a.device == got.device
                and a.dtype == got.dtype and torch.allclose(got, a, 1e-4, 1e-5))
    plus = (lambda t: t) if bias is None else (lambda t: t + bias)
    if bias is not None and tp > 1 and same(expected + (tp - 1) * bias):
        return f" (it holds the bias {tp} times: it was added before the all-reduce)"
    if tp > 1 and same(plus(local)):
        return " (it is this rank's partial sum: nothing added the group's partial sums)"
    if world_sum is not None and same(plus(world_sum)):
        return (" (it is the sum over every rank of the world, not over the tensor-parallel "
                "group)")
    return ""


def run_row_forward(learner: Callable, case: Case) -> Outcome:
    """Runs inside every rank: one case of the row-parallel forward exercise. The reference is
    mpu_lab's RowParallelLinear holding this rank's shard of the same master weight."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    device = initialize.get_device()
    p = case.params
    master, bias, x, grad_y = row_inputs(p, tp, tp_rank, parallel_state.get_data_parallel_rank())
    bias, x, grad_y = (None if bias is None else bias.to(device)), x.to(device), grad_y.to(device)
    layer = RowParallelLinear(*_row_sizes(p, tp), bias=bias is not None,
                              input_is_parallel=p["input_is_parallel"],
                              init_method=functools.partial(_fill, master))
    if bias is not None:
        with torch.no_grad():
            layer.bias.copy_(bias)
    x_ref = x.clone().requires_grad_()
    expected = layer(x_ref)[0]
    expected.backward(grad_y)
    x_in = x.clone().requires_grad_()
    got = learner(x_in, layer.weight.detach().clone(),
                  None if bias is None else bias.clone(), p["input_is_parallel"])
    forward = compare("forward output", expected, got, atol=1e-5, rtol=1e-4)
    # The ranks decide together what comes next: backward and the diagnosis hold collectives.
    mine = [float(forward.ok), float(bool(getattr(got, "requires_grad", False)))]
    agreed = torch.tensor(mine, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    forward_ok, has_grad = (bool(v) for v in agreed.tolist())
    if not forward_ok:
        return _explained(forward, got, expected, layer, x, bias, p["input_is_parallel"])
    if not has_grad:
        return Outcome(bool(mine[1]), "x.grad (the input gradient)",
                       show(x_ref.grad), "no gradient: the output is not connected to x by "
                       "autograd (torch.no_grad, .detach() or a non-differentiable step)")
    got.backward(grad_y)
    grad = compare("x.grad (the input gradient)", x_ref.grad, x_in.grad, atol=1e-5, rtol=1e-4)
    if grad.ok or p["input_is_parallel"] or x_in.grad is None:
        return grad
    block = [torch.zeros_like(b) for b in x_ref.grad.chunk(tp, dim=-1)]
    block[tp_rank] = x_ref.grad.chunk(tp, dim=-1)[tp_rank]
    if torch.allclose(x_in.grad, torch.cat(block, dim=-1), 1e-4, 1e-5):
        grad.what += (f" (right in this rank's block of columns, block {tp_rank}, zero in the "
                      f"others: the split's backward must all-gather the gradient)")
    return grad


def _explained(forward: Outcome, got, expected, layer, x, bias, input_is_parallel: bool) -> Outcome:
    """``forward`` with the slip named when one explains ``got``. Every rank comes here
    together (the ranks agreed above), as the world sum is a collective."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        x_i = x if input_is_parallel else x.chunk(tp, dim=-1)[
            parallel_state.get_tensor_model_parallel_rank()]
        local = torch.nn.functional.linear(x_i, layer.weight)
        world_sum = local.clone()
        dist.all_reduce(world_sum)
    if forward.ok or not hasattr(got, "shape"):
        return forward
    why = _diagnosis(got.detach(), expected.detach(), local, bias, tp,
                     world_sum if dist.get_world_size() > tp else None)
    return dataclasses.replace(forward, what=forward.what + why)


def _row_sizes_fit(input_size: int, world_size: int, tp: int, pp: int) -> Optional[str]:
    if input_size % tp:
        return (f"input_size {input_size} is not divisible by the tensor-parallel size {tp}; "
                f"pick an input_size that is")
    return None


def row_forward_exercise(input_size: int = 1024, output_size: int = 512) -> Exercise:
    """The row-parallel forward exercise; its first two cases use the lab's sizes."""
    lab = {"input_size": input_size, "output_size": output_size, "batch": (4,), "bias": True}
    cases = (
        Case(f"input_is_parallel=False: the whole X [4, {input_size}] on every rank, bias",
             dict(lab, input_is_parallel=False, seed=1)),
        Case(f"input_is_parallel=True: this rank's X_i [4, {input_size}/t], bias",
             dict(lab, input_is_parallel=True, seed=2)),
        Case("a single row: X [1, 3t], bias",
             {"input_per_rank": 3, "output_size": 5, "batch": (1,), "bias": True,
              "input_is_parallel": False, "seed": 3}),
        Case("a 3-D X [s=2, b=3, 2t] (sequence, batch, hidden), bias",
             {"input_per_rank": 2, "output_size": 4, "batch": (2, 3), "bias": True,
              "input_is_parallel": False, "seed": 4}),
        Case("no bias (bias=None), input_is_parallel=True, X_i [2, 2]",
             {"input_per_rank": 2, "output_size": 3, "batch": (2,), "bias": False,
              "input_is_parallel": True, "seed": 5}),
    )
    return Exercise(ROW_FORWARD_NAME, run_row_forward, cases, ROW_FORWARD_HINT,
                    ranks_needed=functools.partial(_row_sizes_fit, input_size))


ROW_FORWARD = row_forward_exercise()


def reduce_from_expected(rank: int, world_size: int, tp: int, pp: int = 1,
                         size: int = 4) -> List[float]:
    """``reduce_from_tensor_model_parallel_region(torch.arange(size) * (r + 1))`` on ``rank``
    when every rank r holds its own multiple of ``arange``: g's forward all-reduce (§3)."""
    total = sum(r + 1 for r in tp_group_of(rank, world_size, tp, pp))
    return [float(i * total) for i in range(size)]


def check_reduce_from(answer: Any, rank: int, world_size: int, tp: int, pp: int = 1) -> Verdict:
    """Predict g's output on ``rank`` when rank r holds ``torch.arange(4.) * (r + 1)``."""
    group = tp_group_of(rank, world_size, tp, pp)
    return check_tensor(answer, reduce_from_expected(rank, world_size, tp, pp),
                         f"rank {rank}'s tensor after reduce_from, a list of 4 numbers",
                         f"arange(4) times the sum of r + 1 over the group {group}.",
                         f"Hint: g all-reduces (sums) over rank {rank}'s tensor-parallel group "
                         f"{group}, element by element.")


# --------------------------------------------------------------------------- answers in sight
# Lab 07's graded answers, computed by the graders above from the arguments the notebook's
# check cells pass (at the stored run's profile, labs/profiles/cpu.yaml, where a cell passes a
# parameter): tests/labs/test_no_answer_before_commit.py searches the notebook for them above
# each answer cell (mpu_lab.labkit.notebooks.leaks).
_STORED = profiles.values_for(profiles.load("cpu"), "07_row_parallel")
_ROW_SHAPE = shard_shapes("row", 1024, 512, 4)[0][::-1]      # W_i = A_i^T
declare_answers([
    ("07", "mlp all-reduces (forward, backward)",
     [(MLP_ALL_REDUCES["forward"], MLP_ALL_REDUCES["backward"])], "check_mlp_all_reduces("),
    ("07", "g's output on the last rank",
     [reduce_from_expected(_STORED["world_size"] - 1, _STORED["world_size"], _STORED["tp"])],
     "check_reduce_from("),
    ("07", "row weight shape", [tuple(_ROW_SHAPE)], "check_row_weight_shape("),
])
