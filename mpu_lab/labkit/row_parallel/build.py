"""Lab 07's build: the learner's whole ``RowParallelLinear``, graded on a live world and, once
right, saved into their package as ``my_megatron/layers.py:RowParallelLinear`` (beside lab 06's
``ColumnParallelLinear``; the capstone, lab 18, builds ``linear_proj`` and ``linear_fc2`` from
it through the layer spec).

The learner's class takes the keyword arguments the mirror's layer specs pass
(``input_size, output_size, bias, input_is_parallel, init_method, skip_bias_add,
sequence_parallel, params_dtype``) and its forward returns ``(output, bias_or_None)``. The
grading is lab 06's (:func:`mpu_lab.labkit.column_parallel.build.run_layer_case`: the layer,
the forward, its collectives, the backward, against the mirror's
:class:`~mpu_lab.core.tensor_parallel.RowParallelLinear` from the same seed at TP = 2), with the
row-parallel slips named: the weight cut along the output (dim 0), a missing g (the output is
this rank's partial sum ``X_i A_i``), the bias added before g (``t`` times), a sum left whole
under sequence parallelism (no reduce-scatter), and a split of the input whose backward does
not all-gather (only this rank's block of ``dL/dX`` filled).

The collectives worked out by hand (Shoeybi et al. 2019, §3; Korthikanti et al. 2022, §4.2.2):
forward one all-reduce (g), or one reduce-scatter with sequence parallelism; backward one
all-gather where the input was split here (``input_is_parallel=False``: the scatter's
backward) or under sequence parallelism (the reduce-scatter's backward), else none.
"""
from __future__ import annotations

from typing import Callable

import torch

from mpu_lab.core import parallel_state, tensor_parallel
from mpu_lab.labkit.column_parallel.build import (block, close, make_case, run_layer_case,
                                                  tp_pairs, two_tp_ranks)
from mpu_lab.labkit.grader import Case, Exercise, Outcome


def _row_diagnosis(got: torch.Tensor, expected: torch.Tensor, ref: torch.nn.Module,
                   x: torch.Tensor) -> str:
    """Name the slip a wrong row-parallel output shows ('' when none matches)."""
    t = parallel_state.get_tensor_model_parallel_world_size()
    bias = ref.bias.detach() if ref.bias is not None else None
    x_i = x if ref.input_is_parallel else block(x, -1)
    partial = torch.nn.functional.linear(x_i, ref.weight.detach())      # X_i A_i
    whole = expected if not ref.sequence_parallel else None
    if ref.sequence_parallel and got.shape[0] == expected.shape[0] * t:
        return ("the whole sum on every rank: with sequence_parallel g is a reduce-scatter, "
                "each rank keeps its block of the sequence (dim 0)")
    if got.shape != expected.shape:
        return ""
    added = bias is not None and not ref.skip_bias_add
    if added and close(got, expected + (t - 1) * bias):
        return (f"the bias {t} times: it was added before g's all-reduce, so every rank's "
                f"copy was summed; add it once, after")
    if whole is not None and close(got, partial + (bias if added else 0)):
        return ("this rank's partial sum X_i A_i: g's all-reduce over the tensor-parallel "
                "group is missing")
    if bias is not None and ref.skip_bias_add and close(got, expected + bias):
        return ("the bias was added: with skip_bias_add the layer returns it and leaves the "
                "adding to the caller")
    if added and close(got + bias, expected):
        return "the bias is missing: add it once, after g (unless skip_bias_add)"
    return ""


def _row_grad_diagnosis(got: torch.Tensor, expected: torch.Tensor, ref: torch.nn.Module,
                        dy: torch.Tensor) -> str:
    """A split whose backward does not gather: only this rank's block of dL/dX is filled."""
    if ref.input_is_parallel:
        return ""
    t = parallel_state.get_tensor_model_parallel_world_size()
    r = parallel_state.get_tensor_model_parallel_rank()
    mine = torch.zeros_like(expected)
    n = expected.shape[-1] // t
    mine[..., r * n:(r + 1) * n] = expected[..., r * n:(r + 1) * n]
    if close(got, mine):
        return ("only this rank's block of dL/dX is filled: the split of the input must "
                "all-gather the gradient's blocks in backward "
                "(scatter_to_tensor_model_parallel_region)")
    return ""


def run_row_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank: one case of the RowParallelLinear build (module docstring)."""
    p = case.params
    flags = {k: p[k] for k in ("bias", "input_is_parallel", "skip_bias_add", "sequence_parallel")}
    sp = flags["sequence_parallel"]
    gathers = ["all-gather"] if sp or not flags["input_is_parallel"] else []
    return run_layer_case(
        learner, case, tensor_parallel.RowParallelLinear, 1, flags,
        {"x": -1 if flags["input_is_parallel"] else None, "y": 0 if sp else None, "bias": None},
        (["reduce-scatter"] if sp else ["all-reduce"], gathers),
        _row_diagnosis, _row_grad_diagnosis,
        "cut along dim 0, the output: that is the column-parallel cut; the row-parallel layer "
        "keeps in/t columns of W = A^T [out, in] (dim 1)")


ROW_CASES = [
    make_case("X [4, 2, 8] -> [4, 2, 6], input_is_parallel=False", 11),
    make_case("input_is_parallel=True", 12, input_is_parallel=True),
    make_case("skip_bias_add=True", 13, input_is_parallel=True, skip_bias_add=True),
    make_case("sequence_parallel=True", 14, input_is_parallel=True, sequence_parallel=True),
    make_case("bias=False, normal_ init, X [3, 1, 4] -> 5", 15, x=(3, 1, 4), output_size=5,
              bias=False, init="normal_(std=0.02)"),
]

ROW_PARALLEL_LINEAR = Exercise(
    name="MyRowParallelLinear",
    run_case=run_row_case,
    cases=ROW_CASES,
    hint=("__init__: draw the whole master weight [output_size, input_size] with init_method "
          "(on the CPU, in fp32: the same numbers on every rank), keep this tensor-parallel "
          "rank's block of COLUMNS (in/t of them) as the Parameter weight, and a zero bias of "
          "the whole output_size. forward(x): unless input_is_parallel, keep this rank's block "
          "of x's last dimension (scatter_to_tensor_model_parallel_region); X_i W_i^T; then g "
          "(reduce_from_tensor_model_parallel_region), or with sequence_parallel the "
          "reduce-scatter (reduce_scatter_to_sequence_parallel_region); the bias once, after, "
          "unless skip_bias_add. Return (output, bias if skip_bias_add else None)."),
    ranks_needed=two_tp_ranks,
    layout=tp_pairs,
    module="layers.py",
    saves_as=("RowParallelLinear",),
)
