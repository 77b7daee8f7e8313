"""The optimizer side of a training step, named after Megatron-core's ``core/optimizer/``:
:func:`build_optimizer` (AdamW with Megatron's weight-decay groups, ``optimizer.py``),
:func:`clip_grad_norm` (the tensor- and pipeline-parallel gradient norm, ``clip_grads.py``)
and :class:`DynamicGradScaler` (fp16 loss scaling, ``grad_scaler.py``), and
:class:`DistributedOptimizer` (``--use-distributed-optimizer``, ``distrib_optimizer.py``)."""
from mpu_lab.core.optimizer.clip_grads import clip_grad_norm
from mpu_lab.core.optimizer.distrib_optimizer import DistributedOptimizer
from mpu_lab.core.optimizer.grad_scaler import DynamicGradScaler
from mpu_lab.core.optimizer.optimizer import build_optimizer

__all__ = ["build_optimizer", "clip_grad_norm", "DistributedOptimizer", "DynamicGradScaler"]
