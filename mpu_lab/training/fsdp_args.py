"""The Megatron-FSDP flags of ``launch/train_gpt.py`` (Megatron-LM's names, in
``_add_distributed_args`` of ``megatron/training/arguments.py``) and their checks in flag
names: ``--use-megatron-fsdp`` and ``--data-parallel-sharding-strategy``
(``no_shard | optim | optim_grads | optim_grads_params``, Megatron-LM's default ``no_shard``).

What the mirror's FSDP does not cover is refused before any process starts, with what would
be valid: pipeline stages (the units' hooks follow one forward and one backward of the whole
model per micro-batch), experts (their own data-parallel group), sequence parallelism under the
strategies that shard gradients (its LayerNorm gradients need a tensor-parallel sum before the
data-parallel reduce-scatter) and ``--dense-twin`` under ``optim_grads_params`` (the twin copies
whole parameters, which live as shards).
"""
from __future__ import annotations

import argparse
from typing import Optional

from mpu_lab.core.distributed.fsdp import (DATA_PARALLEL_SHARDING_STRATEGIES,
                                           SHARDED_GRADIENT_STRATEGIES)
from mpu_lab.training.flag_errors import FlagError

STRATEGY = "--data-parallel-sharding-strategy"


def add_megatron_fsdp_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Megatron-FSDP (ZeRO-1, 2 and 3)")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="wrap the model in Megatron-FSDP: data parallelism whose sharding "
                        f"{STRATEGY} picks")
    g.add_argument(STRATEGY, choices=DATA_PARALLEL_SHARDING_STRATEGIES, default=None,
                   help="what each data-parallel rank keeps only 1/DP of: no_shard nothing; "
                        "optim the optimizer states (ZeRO-1); optim_grads also the gradients "
                        "(ZeRO-2); optim_grads_params also the parameters (ZeRO-3). "
                        "Default with --use-megatron-fsdp: no_shard")


def sharding_strategy(args) -> Optional[str]:
    """The strategy a run uses: None without ``--use-megatron-fsdp``."""
    if not getattr(args, "use_megatron_fsdp", False):
        return None
    return getattr(args, "data_parallel_sharding_strategy", None) or "no_shard"


def check_megatron_fsdp_args(args) -> None:
    """The combinations refused, each with what would be valid."""
    given = getattr(args, "data_parallel_sharding_strategy", None)
    strategy = sharding_strategy(args)
    if given is not None and strategy is None:
        raise FlagError(f"{STRATEGY} {given} shards through Megatron-FSDP, which is off",
                        {"--use-megatron-fsdp": [True], STRATEGY: [None]})
    if strategy is None:
        return
    if getattr(args, "use_distributed_optimizer", False):
        raise FlagError(f"--use-megatron-fsdp {STRATEGY} {strategy} with "
                        f"--use-distributed-optimizer: Megatron-FSDP shards the optimizer "
                        f"states itself ({STRATEGY} optim is the distributed optimizer)",
                        {"--use-distributed-optimizer": [False], "--use-megatron-fsdp": [False]})
    if args.pipeline_model_parallel_size > 1:
        raise FlagError(f"--use-megatron-fsdp with --pipeline-model-parallel-size "
                        f"{args.pipeline_model_parallel_size}: mpu_lab's Megatron-FSDP runs "
                        f"one pipeline stage",
                        {"--pipeline-model-parallel-size": [1], "--use-megatron-fsdp": [False]})
    if getattr(args, "num_experts", None) is not None:
        raise FlagError(f"--use-megatron-fsdp with --num-experts {args.num_experts}: "
                        f"mpu_lab's Megatron-FSDP shards dense models only",
                        {"--num-experts": [None], "--use-megatron-fsdp": [False]})
    if strategy in SHARDED_GRADIENT_STRATEGIES and getattr(args, "sequence_parallel", False):
        raise FlagError(f"{STRATEGY} {strategy} with --sequence-parallel: the sequence-"
                        f"parallel LayerNorm gradients would be reduce-scattered over the "
                        f"data-parallel ranks before their tensor-parallel sum",
                        {"--sequence-parallel": [False], STRATEGY: ["no_shard", "optim"]})
    if strategy == "optim_grads_params" and getattr(args, "dense_twin", False):
        raise FlagError(f"{STRATEGY} optim_grads_params with --dense-twin: the twin copies "
                        f"whole parameters, which live as shards",
                        {"--dense-twin": [False], STRATEGY: ["no_shard", "optim", "optim_grads"]})
