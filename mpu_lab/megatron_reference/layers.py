"""Megatron-core's tensor-parallel layers and mappings next to mpu_lab's, on the ranks of
``launch/megatron_core_side_by_side.py`` (labs 06-08).

With both libraries' parallel state built on the same world
(:func:`mpu_lab.megatron_reference.runtime.initialize`), :func:`compare_linear` runs
Megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` and mpu_lab's from the same
master weight on the same input, forward and backward, and :func:`compare_mappings` does the
same for the communication mappings (:data:`MAPPINGS`). The lab kit prints the per-rank
numbers (:func:`mpu_lab.labkit.column_parallel.megatron_core.format_results`).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from mpu_lab.core.utils import get_device
from mpu_lab.core import parallel_state as ps
from mpu_lab.core import tensor_parallel as tp
from mpu_lab.megatron_reference.runtime import import_megatron

# The keys of a side-by-side report that hold a compare_linear result (_sp: sequence parallel).
LINEAR_KINDS = ("column", "column_sp", "row", "row_sp")

# The mappings compared by compare_mappings: name -> the function name both libraries use.
MAPPINGS = {
    "copy": "copy_to_tensor_model_parallel_region",
    "reduce": "reduce_from_tensor_model_parallel_region",
    "scatter": "scatter_to_tensor_model_parallel_region",
    "gather": "gather_from_tensor_model_parallel_region",
    "scatter_sp": "scatter_to_sequence_parallel_region",
    "gather_sp": "gather_from_sequence_parallel_region",
    "reduce_scatter_sp": "reduce_scatter_to_sequence_parallel_region",
}


def _max_diff(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> float:
    if a is None and b is None:
        return 0.0
    return (a.detach().float() - b.detach().float()).abs().max().item()


def _sequence_shard(x: torch.Tensor, dim: int) -> torch.Tensor:
    t, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return x.chunk(t, dim=dim)[r].contiguous()


def compare_linear(kind: str, input_size: int = 64, output_size: int = 32, seq: int = 8,
                   batch: int = 2, sequence_parallel: bool = False,
                   seed: int = 1234) -> Dict[str, object]:
    """mpu_lab's and Megatron-core's ``kind`` ("column" / "row") parallel linear, side by side.

    Both are built under ``torch.manual_seed(seed)`` with the same ``init_method``; both build
    the full master weight on the CPU and keep this TP rank's slice (Megatron-core's with
    ``use_cpu_initialization=True``). ``same_init`` says whether Megatron-core's own shard
    already equals mpu_lab's; mpu_lab's shard is then copied into it anyway, so the rest
    compares the layers' computation. The same input ``[seq, batch, *]`` and output gradient
    go through both. Column: ``gather_output=True``; row: ``input_is_parallel=False``; with
    ``sequence_parallel`` the Megatron-LM pairing instead (column ``gather_output=False`` on a
    sequence shard, row ``input_is_parallel=True`` returning a sequence shard). Returns
    max |mpu_lab - Megatron-core| of output, input gradient, weight and bias gradients.
    """
    if kind not in ("column", "row"):
        raise ValueError(f"kind must be 'column' or 'row', got {kind!r}")
    _, mtp, ModelParallelConfig = import_megatron()
    device = get_device()
    init = torch.nn.init.xavier_normal_
    t = ps.get_tensor_model_parallel_world_size()
    config = ModelParallelConfig(tensor_model_parallel_size=t, sequence_parallel=sequence_parallel,
                                 use_cpu_initialization=True, params_dtype=torch.float32)
    torch.manual_seed(seed)
    if kind == "column":
        ours = tp.ColumnParallelLinear(input_size, output_size, gather_output=not sequence_parallel,
                                       init_method=init, sequence_parallel=sequence_parallel,
                                       keep_master_weight_for_test=True)
        torch.manual_seed(seed)
        theirs = mtp.ColumnParallelLinear(input_size, output_size, config=config, init_method=init,
                                          bias=True, gather_output=not sequence_parallel)
    else:
        ours = tp.RowParallelLinear(input_size, output_size, input_is_parallel=sequence_parallel,
                                    init_method=init, sequence_parallel=sequence_parallel,
                                    keep_master_weight_for_test=True)
        torch.manual_seed(seed)
        theirs = mtp.RowParallelLinear(input_size, output_size, config=config, init_method=init,
                                       bias=True, input_is_parallel=sequence_parallel,
                                       skip_bias_add=False)
    same_init = torch.equal(theirs.weight.detach().cpu(), ours.weight.detach().cpu())
    with torch.no_grad():                     # the same shard of the same master weight
        theirs.weight.copy_(ours.weight.detach().cpu())
        theirs.bias.copy_(ours.bias.detach().cpu())
    theirs.to(device)

    torch.manual_seed(seed + 1)               # the same full input on every rank
    x = torch.randn(seq, batch, input_size).to(device)  # cpu: CPU RNG: same on any device
    if sequence_parallel:
        x = _sequence_shard(x, 0) if kind == "column" else _sequence_shard(x, -1)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, _ = ours(x_ours)
    y_theirs, _ = theirs(x_theirs)
    torch.manual_seed(seed + 2)
    dy = torch.randn(y_ours.shape).to(device)  # cpu: CPU RNG: same on any device
    y_ours.backward(dy)
    y_theirs.backward(dy)
    return {"tp_rank": ps.get_tensor_model_parallel_rank(), "same_init": same_init,
            "output_shape": list(y_ours.shape),
            "output": _max_diff(y_ours, y_theirs),
            "input_grad": _max_diff(x_ours.grad, x_theirs.grad),
            "weight_grad": _max_diff(ours.weight.grad, theirs.weight.grad),
            "bias_grad": _max_diff(ours.bias.grad, theirs.bias.grad)}


def compare_mappings(seq: int = 8, batch: int = 2, hidden: int = 16,
                     seed: int = 1234) -> Dict[str, Dict[str, float]]:
    """Every mapping of :data:`MAPPINGS`, mpu_lab's and Megatron-core's, on the same tensors.

    Each rank feeds its own input (seeded by ``seed`` and its rank, so the reductions add
    different numbers) of shape ``[seq, batch, hidden]`` — the full tensor for scatters and
    reduce-scatter, this rank's piece for gathers — and the same output gradient to both.
    Returns ``{name: {"forward": max|diff|, "backward": max|diff|}}``.
    """
    _, mtp, _ = import_megatron()
    device = get_device()
    out = {}
    for i, (name, fn_name) in enumerate(MAPPINGS.items()):
        torch.manual_seed(seed + 1000 * i + dist.get_rank())
        x = torch.randn(seq, batch, hidden).to(device)  # cpu: CPU RNG: same on any device
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        ys = [getattr(lib, fn_name)(xi) for lib, xi in zip((tp, mtp), xs)]
        dy = torch.randn(ys[0].shape).to(device)  # cpu: CPU RNG: same on any device
        for y in ys:
            y.backward(dy)
        out[name] = {"forward": _max_diff(*ys), "backward": _max_diff(xs[0].grad, xs[1].grad),
                     "shape": [list(x.shape), list(ys[0].shape)]}
    return out
