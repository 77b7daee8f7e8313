"""Megatron-FSDP's four data-parallel sharding strategies (Megatron-core's
``core/distributed/fsdp/``, ``--use-megatron-fsdp --data-parallel-sharding-strategy S``), after
ZeRO's stages (Rajbhandari et al. 2020, §5):

* ``no_shard``: nothing sharded (data parallelism):
  :class:`~mpu_lab.core.distributed.DistributedDataParallel`, an all-reduce of the gradients;
* ``optim``: the optimizer states (ZeRO-1): the same with ``use_distributed_optimizer`` and
  :class:`~mpu_lab.core.optimizer.DistributedOptimizer`;
* ``optim_grads``: the gradients too (ZeRO-2): :class:`MegatronFSDP`, a reduce-scatter per unit;
* ``optim_grads_params``: the parameters too (ZeRO-3): :class:`MegatronFSDP`, all-gathers per
  unit before its forward and its backward.

The first two are Megatron's data parallelism and distributed optimizer, which the mirror
already has; :class:`MegatronFSDP` (``megatron_fsdp.py``) and its flat per-unit buffers
(``param_and_grad_buffer.py``) do the other two, :class:`FullyShardedOptimizer`
(``fully_shard.py``) steps their shards, and :class:`FullyShardedDataParallel`
(``mcore_fsdp_adapter.py``) picks Megatron-core's units.
"""
from mpu_lab.core.distributed.fsdp.fully_shard import FullyShardedOptimizer
from mpu_lab.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from mpu_lab.core.distributed.fsdp.megatron_fsdp import (
    DATA_PARALLEL_SHARDING_STRATEGIES, SHARDED_GRADIENT_STRATEGIES, MegatronFSDP, fsdp_units,
    unsharded_parameters)
from mpu_lab.core.distributed.fsdp.param_and_grad_buffer import AllGatherPipeline, ParameterGroup

__all__ = ["DATA_PARALLEL_SHARDING_STRATEGIES", "SHARDED_GRADIENT_STRATEGIES", "AllGatherPipeline",
           "FullyShardedDataParallel", "FullyShardedOptimizer", "MegatronFSDP", "ParameterGroup",
           "fsdp_units", "unsharded_parameters"]
