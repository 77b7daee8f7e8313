"""Megatron-core's own Megatron-FSDP beside the mirror's, on the CPU: :func:`compare_on_rank`
runs on every rank of a playground world and trains one small MLP three ways with AdamW:
Megatron-core's ``fully_shard`` (``megatron/core/distributed/fsdp/src/megatron_fsdp/``,
ZeRO-3, one unit per ``Linear``; checked with 0.16.1 and 0.19.2), the mirror's
:class:`~mpu_lab.core.distributed.fsdp.MegatronFSDP` (``optim_grads_params``, the same units),
and a single process on the whole global batch (the reference). :func:`format_comparison`
prints the largest difference of each from the reference.

Megatron-core runs inside :func:`mpu_lab.megatron_reference.cpu.megatron_fsdp_patches` (the
one module allowed to patch ``torch.cuda``): the CPU patches every Megatron-core side-by-side
uses (:func:`~mpu_lab.megatron_reference.cpu.cpu_patches`) and, for Megatron-FSDP, what more it
needs (found one error at a time):

* ``torch.cuda.current_device()`` returns the index 0 instead of ``"cpu"``:
  ``MegatronFSDP.__init__`` builds ``torch.device(f"cuda:{torch.cuda.current_device()}")``
  (``cuda:cpu`` is no device) only to warn when it differs from the device given;
* the events that ``torch.cuda.Event`` and a stream's ``record_event`` give stand in with a
  ``wait()``: the gradient pipeline waits on the event of each earlier reduce-scatter
  (``wait_for_previous_grad_reduce``);
* not a patch, a setting: ``ddp_config.gradient_reduce_div_fusion = False``. By default the
  average is fused into the reduce-scatter as ``ReduceOp.PREMUL_SUM``, which gloo lacks.

Two more things make one call serve 0.16.1 and 0.19.2 alike, neither a patch:

* the mesh has a trivial tensor-parallel dimension of size 1 named ``tp_dim``: 0.19 looks up
  the tensor-parallel submesh by that name and, without it, stops with ``No submesh with
  mesh_dim_names=(None,)`` (0.16 accepts the extra dimension);
* 0.19's ``fully_shard`` builds the optimizer's state up front with one ``step()`` on zero
  gradients (for checkpoint loading): no weight moves, but AdamW counts the step, so its bias
  correction would run one step ahead of the reference. The step counts are set back to 0
  (0.16 builds the state at the first real step: nothing to reset).

Everything is put back on leaving; the patches live in the ranks only while this runs.
"""
from __future__ import annotations

import contextlib
import logging
import types
import warnings
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from mpu_lab.core import parallel_state
from mpu_lab.core.distributed.fsdp import FullyShardedOptimizer, MegatronFSDP
from mpu_lab.megatron_reference import cpu as megatron_cpu

LR, BETAS, EPS = 0.01, (0.9, 0.999), 1e-8


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Megatron-core's notes that a CPU run provokes (no Transformer Engine or Apex; its
    device is not ``cuda:0``) kept out of the rank's output."""
    log = logging.getLogger("megatron.core")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def _mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batches(d: int, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn(4, 8, generator=gen),   # cpu: Megatron-core runs on the CPU mesh
              torch.randn(4, 4, generator=gen))  # cpu: the same
             for _ in range(d)] for _ in range(steps)]


def _adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)


def _reference(data, seed: int) -> List[torch.Tensor]:
    model = _mlp(seed)
    opt = _adamw(model.parameters())
    for step in data:
        opt.zero_grad()
        x, y = torch.cat([x for x, _ in step]), torch.cat([y for _, y in step])
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _mirror(data, seed: int, group, me: int) -> List[torch.Tensor]:
    model = _mlp(seed)
    fsdp = MegatronFSDP(model, group, "optim_grads_params", fsdp_unit_modules=[torch.nn.Linear])
    args = types.SimpleNamespace(lr=LR, weight_decay=0.0, adam_beta1=BETAS[0],
                                 adam_beta2=BETAS[1], adam_eps=EPS)
    opt = FullyShardedOptimizer([fsdp], args)
    for step in data:
        opt.zero_grad()
        x, y = step[me]
        torch.nn.functional.mse_loss(fsdp(x), y).backward()
        fsdp.finish_grad_sync()
        opt.step()
    with fsdp.unsharded_parameters():
        return [p.detach().clone() for p in model.parameters()]


def _megatron_core(data, seed: int, me: int) -> List[Tuple[torch.Tensor, tuple]]:
    from megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard import fully_shard
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        update_uneven_dtensor_chunk_metadata)
    from torch.distributed.device_mesh import init_device_mesh

    model = _mlp(seed)
    opt = _adamw(model.parameters())
    # a trivial tensor-parallel dimension of size 1 beside the data-parallel one: 0.19 looks
    # its submesh up by tp_dim ("No submesh with mesh_dim_names=(None,)" without it); 0.16
    # accepts it too
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
    with megatron_cpu.megatron_fsdp_patches(), _quiet():
        model, opt = fully_shard(model, opt, device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp",
                                 fsdp_unit_modules=[torch.nn.Linear], zero_dp_strategy=3,
                                 device=torch.device("cpu"))
        model.ddp_config.gradient_reduce_div_fusion = False     # gloo has no PREMUL_SUM
        # 0.19 builds AdamW's state inside fully_shard with one step on zero gradients: no
        # weight moves, but the step count says 1, so the bias correction would run a step
        # ahead of the reference; set it back to 0 (0.16 builds the state lazily: none here)
        for state in opt.state.values():
            if "step" in state:
                state["step"].zero_()
        for step in data:
            opt.zero_grad()
            x, y = step[me]
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        # its parameters are DTensors cut unevenly (by rows of the flat buffer): this rank's
        # piece and where it lies (gloo's all-gather cannot assemble uneven pieces)
        pieces = []
        for p in model.parameters():
            if not hasattr(p._local_tensor, "__create_chunk_list__"):
                update_uneven_dtensor_chunk_metadata(p)
            local = p.to_local().detach().clone()
            offsets = p.__create_chunk_list__()[0].offsets
            pieces.append((local, tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))))
        return pieces


def compare_on_rank(steps: int = 3, seed: int = 0) -> Dict[str, object]:
    """Runs on every rank of a world at tensor-parallel size 1 (``d`` = the world): the
    largest absolute difference from the reference of each library's parameters after
    ``steps`` AdamW steps (the mirror's whole parameters; Megatron-core's piece on this rank),
    or the error that stopped Megatron-core (first line)."""
    d, me = dist.get_world_size(), dist.get_rank()
    if parallel_state.get_data_parallel_world_size() != d:
        raise ValueError(f"compare_on_rank shards over the whole world: it needs tensor- and "
                         f"pipeline-parallel size 1, got a data-parallel size of "
                         f"{parallel_state.get_data_parallel_world_size()} in a world of {d}")
    data = _batches(d, steps, seed + 1)
    reference = _reference(data, seed)
    out: Dict[str, object] = {"rank": me, "d": d, "steps": steps}
    mirror = _mirror(data, seed, parallel_state.get_data_parallel_group(), me)
    out["mpu_lab"] = max(float((a - b).abs().max()) for a, b in zip(mirror, reference))
    try:
        with _quiet():          # importing it warns too
            core = _megatron_core(data, seed, me)
    except ImportError as exc:
        out["megatron-core"] = f"not installed ({exc}): pip install megatron-core"
        return out
    except Exception as exc:           # what blocks it, reported rather than raised
        out["megatron-core"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        return out
    out["megatron-core"] = max((float((piece - ref[where]).abs().max()) if piece.numel() else 0.0)
                               for (piece, where), ref in zip(core, reference))
    return out


def format_comparison(results: List[Dict[str, object]], bound: float = 1e-6) -> str:
    """One line per library: the largest difference over the ranks and the verdict against
    ``bound`` (absolute, fp32), or what stopped it."""
    d, steps = results[0]["d"], results[0]["steps"]
    lines = [f"parameters after {steps} AdamW steps at d = {d}, largest |difference| from the "
             f"single-process reference:"]
    for lib in ("mpu_lab", "megatron-core"):
        values = [r[lib] for r in results]
        if all(isinstance(v, float) for v in values):
            worst = max(values)
            lines.append(f"  {lib:>13}: {'within' if worst <= bound else 'NOT within'} "
                         f"{bound:g} on every rank")
        else:
            lines.append(f"  {lib:>13}: {next(v for v in values if not isinstance(v, float))}")
    return "\n".join(lines)
