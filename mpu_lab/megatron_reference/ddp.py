"""Megatron-core's ``DistributedDataParallel`` and ``DistributedOptimizer`` next to mpu_lab's,
on the same model, the same data and the same world (lab 04; issue 28).

Rank side (inside ``launch/megatron_core_ddp.py``'s ranks, with mpu_lab's groups made and
Megatron-core's parallel state built on the same world by
:func:`mpu_lab.megatron_reference.runtime.initialize`): :func:`compare_ddp` trains three copies of
one small MLP, all from the same seed, for a few Adam steps:

* **Megatron-core**: its ``DistributedDataParallel`` (grad buffers, buckets) and its optimizer
  (``get_megatron_optimizer``: ``DistributedOptimizer`` when ``use_distributed_optimizer``);
* **mpu_lab**: :class:`mpu_lab.core.distributed.DistributedDataParallel` with
  :func:`mpu_lab.core.optimizer.build_optimizer` or :class:`mpu_lab.core.optimizer.DistributedOptimizer`;
* **the reference**: one plain ``torch.nn`` copy on the whole global batch (every rank's data,
  made here from the ranks' seeds) and ``torch.optim.AdamW``: no collective at all.

Each rank reports max |library - reference| of the averaged gradients of the first step (the
all-reduce modes: with the distributed optimizer a rank holds the average of its own shard
only) and of the parameters after every step. Megatron-core runs under
:func:`mpu_lab.megatron_reference.cpu.cpu_patches` on a CPU rank.
"""
from __future__ import annotations

import types
import warnings
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

from mpu_lab.training import initialize
from mpu_lab.core import optimizer
from mpu_lab.core import parallel_state as ps
from mpu_lab.core.distributed.distributed_data_parallel import DistributedDataParallel
from mpu_lab.megatron_reference import runtime as megatron_core
from mpu_lab.megatron_reference.cpu import cpu_patches

# name -> (overlap_grad_reduce, use_distributed_optimizer)
MODES = {"all-reduce": (False, False), "all-reduce + overlap": (True, False),
         "distributed optimizer": (False, True),
         "distributed optimizer + overlap": (True, True)}
SIZES = (16, 48, 48, 8)          # the MLP's widths: three Linear layers, tanh between
ADAM = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
BUCKET_SIZE = 1000               # elements: a few buckets for the MLP's ~3,600 parameters
TOL = 1e-5                       # fp32; issue 28 measured 5.4e-7 (gradients), 2.1e-7 (params)


def build_mlp(seed: int, sizes: Sequence[int] = SIZES) -> torch.nn.Sequential:
    """The model every library trains: Linear, tanh, ..., Linear, fp32, made under ``seed``."""
    torch.manual_seed(seed)
    layers: List[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def rank_batch(rank: int, step: int, batch: int, sizes: Sequence[int] = SIZES):
    """``(x, y)`` of data-parallel rank ``rank`` at ``step``: its own samples."""
    gen = torch.Generator().manual_seed(1000 * step + rank + 1)
    x = torch.randn(batch, sizes[0], generator=gen, device="cpu")  # cpu: the job runs on CPUs
    return x, torch.randn(batch, sizes[-1], generator=gen, device="cpu")  # cpu: the same


def _loss(model, x, y) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def _max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max((p.detach().cpu() - q.detach().cpu()).abs().max().item() for p, q in zip(a, b))


def _megatron_ddp(model, overlap: bool, dist_opt: bool):
    """Megatron-core's DDP and optimizer around ``model`` (fp32 parameters and gradients)."""
    from megatron.core.distributed import (  # optional, slow to import: only where it is used
        DistributedDataParallel as MegatronDDP, DistributedDataParallelConfig)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    config = TransformerConfig(num_layers=1, hidden_size=SIZES[1], num_attention_heads=1,
                               params_dtype=torch.float32, use_cpu_initialization=True)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
        use_distributed_optimizer=dist_opt, bucket_size=BUCKET_SIZE)
    ddp = MegatronDDP(config, ddp_config, model)
    opt_config = OptimizerConfig(optimizer="adam", lr=ADAM["lr"], weight_decay=0.0,
                                 adam_beta1=ADAM["betas"][0], adam_beta2=ADAM["betas"][1],
                                 adam_eps=ADAM["eps"], clip_grad=0.0, bf16=False, fp16=False,
                                 params_dtype=torch.float32, use_distributed_optimizer=dist_opt)
    # the world is gloo already: no second set of gloo groups for the optimizer
    return ddp, get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=False)


def _mpu_lab_ddp(model, overlap: bool, dist_opt: bool):
    ddp = DistributedDataParallel(model, ps.get_data_parallel_group(),
                                  overlap_grad_reduce=overlap,
                                  use_distributed_optimizer=dist_opt, bucket_size=BUCKET_SIZE)
    args = types.SimpleNamespace(lr=ADAM["lr"], weight_decay=0.0, adam_beta1=ADAM["betas"][0],
                                 adam_beta2=ADAM["betas"][1], adam_eps=ADAM["eps"])
    opt = optimizer.DistributedOptimizer([ddp], args) if dist_opt \
        else optimizer.build_optimizer(model, args)
    return ddp, opt


def compare_ddp(mode: str, steps: int = 3, batch: int = 4, seed: int = 1234) -> Dict[str, object]:
    """One mode of :data:`MODES` on this rank: ``{"mode", "grad": max|diff| of the first
    step's averaged gradients per library (None with the distributed optimizer), "params":
    [max|diff| after each step] per library, "buckets": per library}``."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    overlap, dist_opt = MODES[mode]
    group = ps.get_data_parallel_group()
    d, me = dist.get_world_size(group), dist.get_rank(group)
    on_cpu = initialize.get_device().type == "cpu"
    reference = build_mlp(seed)
    ref_opt = torch.optim.AdamW(reference.parameters(), weight_decay=0.0, **ADAM)
    out = {"mode": mode, "grad": {}, "params": {"megatron-core": [], "mpu_lab": []}}
    with cpu_patches(on_cpu), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine.*|.*Apex.*")
        libs = {"megatron-core": _megatron_ddp(build_mlp(seed), overlap, dist_opt),
                "mpu_lab": _mpu_lab_ddp(build_mlp(seed), overlap, dist_opt)}
        out["buckets"] = {"megatron-core": sum(len(b.buckets) for b in
                                               libs["megatron-core"][0].buffers),
                          "mpu_lab": len(libs["mpu_lab"][0].buffer.buckets)}
        for step in range(steps):
            data = [rank_batch(r, step, batch) for r in range(d)]
            ref_opt.zero_grad()
            _loss(reference, torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
                  ).backward()
            for name, (ddp, opt) in libs.items():
                opt.zero_grad()          # first: a torch optimizer sets .grad to None
                ddp.zero_grad_buffer()   # then .grad points into the zeroed buffer again
                _loss(ddp, *data[me]).backward()
                ddp.finish_grad_sync()
                if step == 0 and not dist_opt:
                    out["grad"][name] = _max_diff(
                        [p.main_grad for p in ddp.module.parameters()],
                        [p.grad for p in reference.parameters()])
                opt.step()
            ref_opt.step()
            for name, (ddp, _) in libs.items():
                out["params"][name].append(_max_diff(list(ddp.module.parameters()),
                                                     list(reference.parameters())))
    return out


def run_rank(modes: Sequence[str] = tuple(MODES), steps: int = 3) -> Dict[str, object]:
    """What one rank of ``launch/megatron_core_ddp.py`` reports: Megatron-core's version, and
    :func:`compare_ddp` for each mode (Megatron-core's parallel state built once)."""
    megatron_core.initialize()
    try:
        return {"rank": dist.get_rank(), "d": ps.get_data_parallel_world_size(),
                "megatron_core": megatron_core.version(),
                "modes": [compare_ddp(m, steps) for m in modes]}
    finally:
        megatron_core.destroy(mpu_lab_too=False)


def worst(results: List[Dict[str, object]]) -> float:
    """The largest difference from the reference in a job's reports, any rank, mode, library."""
    values = [v for r in results for m in r["modes"] for v in m["grad"].values()]
    values += [v for r in results for m in r["modes"] for vs in m["params"].values() for v in vs]
    return max(values)
