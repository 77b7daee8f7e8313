"""Data parallelism as Megatron-core's ``core/distributed/`` does it: its
:class:`DistributedDataParallel` over a contiguous gradient buffer split into buckets
(``param_and_grad_buffer.py``), and the gradient reductions between backward and the optimizer
step (``finalize_model_grads.py``)."""
from mpu_lab.core.distributed.distributed_data_parallel import DistributedDataParallel
from mpu_lab.core.distributed.finalize_model_grads import (
    allreduce_data_parallel_grads, allreduce_sequence_parallel_grads, finalize_model_grads)
from mpu_lab.core.distributed.param_and_grad_buffer import ParamAndGradBuffer

__all__ = ["DistributedDataParallel", "ParamAndGradBuffer", "allreduce_data_parallel_grads",
           "allreduce_sequence_parallel_grads", "finalize_model_grads"]
