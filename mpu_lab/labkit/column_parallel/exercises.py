"""Lab 06's exercises and rank-side helpers.

* Checks of an answer: a column-parallel weight's shape (:func:`check_column_weight_shape`),
  the rows a strided (fused) split keeps (:func:`check_strided_rows`).
* Write the code: :data:`COLUMN_FORWARD`, the learner's column-parallel forward from a shard,
  graded on every rank of a playground world against ``ColumnParallelLinear`` built from the
  same master weight (forward, and ``x.grad``: f's all-reduce).
* A rank-side helper of the lab's RNG section: :func:`shard_init_matches_single_gpu`.
* The MPU walkthrough's master weight, built its way and Megatron's
  (:func:`print_walkthrough_master_weight`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state, tensor_parallel
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
from mpu_lab.labkit.column_parallel.viz import shard_shapes, strided_owners


def _column_weight_shape(input_size: int, output_size: int, tp: int) -> tuple:
    (rows, cols) = shard_shapes("column", input_size, output_size, tp)[0]  # A_i: [in, out/t]
    return (cols, rows)                                                        # W_i = A_i^T


def check_column_weight_shape(answer: Any, input_size: int, output_size: int, tp: int) -> Verdict:
    """Shape of one rank's ``ColumnParallelLinear(input_size, output_size).weight`` at ``tp``."""
    if unanswered(answer, "a shape such as (rows, cols)"):
        return Verdict(False)
    expected = _column_weight_shape(input_size, output_size, tp)
    given = as_int_list(answer)
    right = (f"each rank stores weight {expected}: A_i = [{input_size}, {output_size // tp}] "
             f"transposed, cut by the tensor-parallel size {tp}.")
    if given is not None and tuple(given) == expected[::-1] and expected[0] != expected[1]:
        return verdict(False, right, f"{tuple(given)} is A_i = [in, out/t]; the Parameter "
                                     f"stores W_i = A_i^T because F.linear computes X W^T.")
    return verdict(given is not None and tuple(given) == expected, right,
                    f"{answer!r} is not it. Hint: the columns of A (output_size) are cut into t "
                    f"pieces, and the weight is stored as [out/t, in].")


def check_strided_rows(answer: Any, rank: int, size: int, tp: int, stride: int) -> Verdict:
    """Which rows of a fused ``[size, ...]`` master weight does ``rank`` keep with ``stride``?"""
    if unanswered(answer, f"the list of master-weight rows that rank {rank} keeps"):
        return Verdict(False)
    owners = strided_owners(size, tp, stride)
    expected = [row for row, owner in enumerate(owners) if owner == rank]
    given = as_int_list(answer)
    return verdict(given is not None and sorted(given) == expected,
                    f"rank {rank} keeps rows {expected}: one piece of {size // (tp * stride)} "
                    f"rows from each of the {stride} fused parts.",
                    f"{answer!r} is not it. Hint: cut the {size} rows into tp*stride = "
                    f"{tp * stride} pieces; rank r keeps pieces r, r+{tp}, r+{2 * tp}, ...")



# --------------------------------------------------------------------------- where the first weights come from
def shard_init_matches_single_gpu(seed: int = 1234, rows_per_rank: int = 2,
                                  cols: int = 8) -> Dict[str, bool]:
    """Runs on a rank of a playground world: does this rank's first weight shard equal its rows
    of the weight a single GPU (TP = 1) starts from, when the weights are made

    * ``"mpu_lab"``: the way mpu_lab (and Megatron with ``--use-cpu-initialization``) makes
      them: the whole master under the default generator, seeded ``seed`` on every rank, then
      this rank's slice (``ColumnParallelLinear``);
    * ``"megatron_default"``: the way Megatron makes them by default: each rank draws only its
      shard, on its device, inside ``get_rng_tracker().fork()`` (its tensor-parallel stream,
      seeded ``seed + 2718 + tp_rank``; ``_initialize_affine_weight_gpu``)?

    The single GPU's weights are drawn here from fresh generators: at TP = 1 the default stream
    is ``seed`` and the only tensor-parallel stream is ``seed + 2718`` (tp rank 0). The init is
    ``normal_`` (Megatron's GPT init is a normal distribution). Reseeds this rank's generators
    (``model_parallel_manual_seed(seed)``)."""
    t = parallel_state.get_tensor_model_parallel_world_size()
    r = parallel_state.get_tensor_model_parallel_rank()
    device = initialize.get_device()
    rows = slice(r * rows_per_rank, (r + 1) * rows_per_rank)
    tensor_parallel.model_parallel_manual_seed(seed)
    mine = tensor_parallel.ColumnParallelLinear(cols, rows_per_rank * t, bias=False,
                                                init_method=torch.nn.init.normal_).weight
    own = torch.empty(rows_per_rank, cols, device=device)
    with tensor_parallel.get_rng_tracker().fork():
        torch.nn.init.normal_(own)
    dense_mpu_lab = torch.nn.init.normal_(
        torch.empty(rows_per_rank * t, cols, device="cpu"),  # cpu: made where mpu_lab makes masters
        generator=torch.Generator(device="cpu").manual_seed(seed))
    dense_megatron = torch.nn.init.normal_(
        torch.empty(rows_per_rank * t, cols, device=device),
        generator=torch.Generator(device=device).manual_seed(seed + 2718))
    return {"mpu_lab": torch.equal(mine.detach().cpu(), dense_mpu_lab[rows]),
            "megatron_default": torch.equal(own, dense_megatron[rows])}


# ---------------------------------------------------------------- the walkthrough's master weight
def _rows(rows) -> str:
    """``rows`` (a list of row numbers) in a few words: ``0, 16, 32, ..., 496 (32 rows)``."""
    head = ", ".join(str(r) for r in rows[:3])
    return f"{head}, ..., {rows[-1]} ({len(rows)} rows)" if len(rows) > 4 else \
        ", ".join(map(str, rows)) + f" ({len(rows)} rows)"


def walkthrough_master_weight(input_size: int = 1024, output_size: int = 512,
                              world_size: int = 16, tp: int = 2) -> Dict[str, Any]:
    """The MPU walkthrough's master weight, two more slips shown on tensors (one process).

    * Its ``m_initialize_affine_weight_cpu`` makes ``torch.empty(output_size, input_size)`` and
      never passes it to ``init_method``: ``torch.empty`` draws no random numbers (the default
      generator's state is unchanged), so the "master" is whatever that memory held.
    * Its ``get_weight_list`` takes ``master_weight[gp::world_size]``: every ``world_size``-th
      row starting at ``gp``, not the contiguous block ``torch.split`` gives (which its own
      ``weight_list`` computes and leaves unused). Each row of the master here holds its row
      number, so a slice shows the rows it took; and with random weights, each rank's
      ``Y_i = X A_i`` all-gathered is compared with the dense ``X A`` for both ways of cutting
      into ``tp`` pieces.
    Returns the facts; :func:`print_walkthrough_master_weight` prints them."""
    before = torch.random.get_rng_state()
    torch.empty(output_size, input_size)   # cpu: the notebook's process, as the walkthrough
    numbered = torch.arange(output_size)[:, None].expand(  # cpu: one process; row i holds i
        output_size, input_size)
    interleaved = [numbered[gp::world_size][:, 0].tolist() for gp in range(2)]
    blocks = [b[:, 0].tolist() for b in torch.split(numbered, output_size // tp, dim=0)]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, input_size, generator=gen)     # cpu: one process, no rank
    w = torch.randn(output_size, input_size, generator=gen)   # cpu: one process; [out, in]: A = w^T
    dense = x @ w.t()

    def gathered(shards):    # each rank's Y_i = X A_i, then the all-gather along the columns
        return torch.cat([x @ shard.t() for shard in shards], dim=-1)

    return {"empty_draws_nothing": torch.equal(before, torch.random.get_rng_state()),
            "interleaved_rows": interleaved, "block_rows": blocks,
            "interleaved_gathers_to_dense": torch.allclose(
                gathered([w[r::tp] for r in range(tp)]), dense, atol=1e-4),
            "blocks_gather_to_dense": torch.allclose(
                gathered(torch.split(w, output_size // tp, dim=0)), dense, atol=1e-4),
            "sizes": (input_size, output_size, world_size, tp)}


def print_walkthrough_master_weight(**sizes) -> Dict[str, Any]:
    """Print :func:`walkthrough_master_weight`'s facts, one line each."""
    got = walkthrough_master_weight(**sizes)
    input_size, output_size, world_size, tp = got["sizes"]
    print(f"torch.empty({output_size}, {input_size}) left the random generator's state as it was "
          f"(it drew no numbers): {got['empty_draws_nothing']}")
    for gp, rows in enumerate(got["interleaved_rows"]):
        print(f"walkthrough, master_weight[{gp}::{world_size}]: rows {_rows(rows)}")
    for i, rows in enumerate(got["block_rows"]):
        print(f"Megatron, torch.split(master_weight, {output_size // tp})[{i}]: rows {_rows(rows)}")
    print(f"t = {tp} ranks' X A_i, all-gathered, equal the dense X A: rows [r::{tp}] "
          f"{got['interleaved_gathers_to_dense']}, torch.split blocks "
          f"{got['blocks_gather_to_dense']}")
    return got


# --------------------------------------------------------------------------- write the code
_COLUMN_CASES = [
    Case("the walkthrough's A [1024, 512], X [4, 1024], gather_output=True",
         {"shape": [4], "input_size": 1024, "output_size": 512, "gather_output": True}),
    Case("the walkthrough's A [1024, 512], X [4, 1024], gather_output=False",
         {"shape": [4], "input_size": 1024, "output_size": 512, "gather_output": False}),
    Case("A [16, 3t] (3 columns per rank), X [5, 16], gather_output=True",
         {"shape": [5], "input_size": 16, "columns_per_rank": 3, "gather_output": True}),
    Case("one row: X [1, 16], A [16, 2t], gather_output=False",
         {"shape": [1], "input_size": 16, "columns_per_rank": 2, "gather_output": False}),
    Case("one row: X [1, 16], A [16, 2t], gather_output=True",
         {"shape": [1], "input_size": 16, "columns_per_rank": 2, "gather_output": True}),
    Case("X [3, 2, 16] (sequence, batch, hidden), A [16, 4t], gather_output=True",
         {"shape": [3, 2], "input_size": 16, "columns_per_rank": 4, "gather_output": True}),
]
_WALKTHROUGH_OUTPUT = 512


def _column_inputs(params: Dict[str, Any], t: int, seed: int = 2):
    """The case's master weight ``[out, in]``, bias ``[out]``, input ``X`` and ``dL/dY``
    ``[..., out]``: drawn on the CPU from one seeded generator, so every rank (and every
    device) has the same numbers, then moved to this rank's device (the master stays on the
    CPU: ColumnParallelLinear slices it there)."""
    out = params.get("output_size") or params["columns_per_rank"] * t
    inp = params["input_size"]
    g = torch.Generator(device="cpu").manual_seed(seed)
    master = torch.randn(out, inp, generator=g, device="cpu") / inp ** 0.5  # cpu: the master weight
    bias = torch.randn(out, generator=g, device="cpu")                      # cpu: sliced per rank
    x = torch.randn(*params["shape"], inp, generator=g, device="cpu")       # cpu: same on every rank
    dy = torch.randn(*params["shape"], out, generator=g, device="cpu")      # cpu: same on every rank
    return master, bias, x, dy


def run_column_forward_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank: the learner's ``my_column_forward(x, weight_shard, bias_shard,
    gather_output)`` against mpu_lab's ``ColumnParallelLinear`` built from the same master
    weight and bias: the output ``Y`` (the whole ``Y`` or this rank's block), then ``x.grad``
    after ``Y.backward(dL/dY)`` (f's all-reduce over the tensor-parallel group)."""
    t = parallel_state.get_tensor_model_parallel_world_size()
    r = parallel_state.get_tensor_model_parallel_rank()
    device = initialize.get_device()
    gather = bool(case.params["gather_output"])
    master, bias, x, dy = _column_inputs(case.params, t)
    layer = tensor_parallel.ColumnParallelLinear(
        master.shape[1], master.shape[0], bias=True, gather_output=gather,
        init_method=lambda w: w.copy_(master))
    n = layer.output_size_per_partition
    with torch.no_grad():
        layer.bias.copy_(bias[r * n:(r + 1) * n].to(device))
    grad_y = (dy if gather else dy[..., r * n:(r + 1) * n]).to(device)

    # Two separate leaves (on a CPU rank x.to(device) is x itself: their grads would add up).
    x_ref = x.to(device).clone().requires_grad_()
    y_ref, _ = layer(x_ref)
    x_learner = x.to(device).clone().requires_grad_()
    y = learner(x_learner, layer.weight.detach().clone(), layer.bias.detach().clone(), gather)
    forward = compare("Y (forward)", y_ref, y, atol=1e-4, rtol=1e-4)
    y_ref.backward(grad_y)
    differentiable = forward.ok and bool(y.requires_grad)
    # Backward only where every rank's Y was right: the learner's backward may hold a
    # collective (f's all-reduce), and a rank that skipped it would leave its peers waiting.
    if not _on_every_rank(differentiable):
        if not forward.ok:
            return forward
        if not differentiable:
            return Outcome(False, "x.grad (backward)", show(x_ref.grad),
                           "no gradient: Y does not depend on x through autograd")
        return Outcome(True, "Y (forward)")   # another rank's Y was wrong: it reports
    y.backward(grad_y)
    return compare("x.grad (backward)", x_ref.grad, x_learner.grad, atol=1e-4, rtol=1e-4)


def _on_every_rank(flag: bool) -> bool:
    """True when ``flag`` is true on every rank of the world (a MIN all-reduce)."""
    value = torch.tensor([1 if flag else 0], device=initialize.get_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
    return bool(value.item())


def _walkthrough_sizes_fit(world_size: int, tp: int, pp: int) -> Optional[str]:
    if _WALKTHROUGH_OUTPUT % tp:
        return (f"the cases cut {_WALKTHROUGH_OUTPUT} columns over the tensor-parallel size, "
                f"and tp = {tp} does not divide {_WALKTHROUGH_OUTPUT} (use 1, 2, 4 or 8)")
    return None


COLUMN_FORWARD = Exercise(
    name="my_column_forward",
    run_case=run_column_forward_case,
    cases=_COLUMN_CASES,
    hint=("three steps on every rank. f before the matmul: its backward adds dL/dX over the "
          "tensor-parallel group. Then this rank's Y_i = X A_i + b_i with the shard as stored, "
          "weight_shard = A_i^T of shape [out/t, in] (as torch.nn.Linear stores it). Then, "
          "only when gather_output is True, the all-gather of the blocks of columns along the "
          "LAST dimension. The *_region functions of mpu_lab.core.tensor_parallel.mappings are "
          "defined on every rank."),
    ranks_needed=_walkthrough_sizes_fit,
)


def copy_to_grad_expected(rank: int, world_size: int, tp: int, pp: int = 1,
                          size: int = 4) -> List[float]:
    """``x.grad`` on ``rank`` after ``y = copy_to_tensor_model_parallel_region(x)`` and
    ``y.backward(torch.full((size,), r + 1.0))`` on every rank r: f's backward all-reduces
    dL/dy over the tensor-parallel group (Megatron-LM, Shoeybi et al. 2019, §3, Fig. 3)."""
    return [float(sum(r + 1 for r in tp_group_of(rank, world_size, tp, pp)))] * size


def check_copy_to_grad(answer: Any, rank: int, world_size: int, tp: int, pp: int = 1) -> Verdict:
    """Predict ``x.grad`` on ``rank`` after f with dL/dy = rank + 1 on every rank (4 values)."""
    group = tp_group_of(rank, world_size, tp, pp)
    return check_tensor(answer, copy_to_grad_expected(rank, world_size, tp, pp),
                         f"rank {rank}'s x.grad, a list of 4 numbers",
                         f"the sum of r + 1 over the group {group}.",
                         f"Hint: f's backward all-reduces dL/dy over rank {rank}'s "
                         f"tensor-parallel group {group}; each rank r sent r + 1.")


# --------------------------------------------------------------------------- answers in sight
# Lab 06's graded answers, computed by the graders above from the arguments the notebook's
# check cells pass (at the stored run's profile, labs/profiles/cpu.yaml, where a cell passes a
# parameter): tests/labs/test_no_answer_before_commit.py searches the notebook for them above
# each answer cell (mpu_lab.labkit.notebooks.leaks).
_STORED = profiles.values_for(profiles.load("cpu"), "06_column_parallel")
_COPY_GRAD = copy_to_grad_expected(_STORED["world_size"] - 1, _STORED["world_size"], _STORED["tp"])
_STRIDED = [row for row, owner in enumerate(strided_owners(16, 4, 2)) if owner == 1]
declare_answers([
    ("06", "f's x.grad on the last rank", [_COPY_GRAD], "check_copy_to_grad("),
    ("06", "column weight shape", [_column_weight_shape(1024, 768, 4)],
     "check_column_weight_shape("),
    ("06", "strided rows of rank 1", [_STRIDED], "check_strided_rows("),
])
