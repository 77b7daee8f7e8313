"""Tensor (intra-layer) model parallelism after Shoeybi et al. 2019, "Megatron-LM", §3,
with the sequence-parallel operators of Korthikanti et al. 2022.

Modules, named as in Megatron-core's ``megatron.core.tensor_parallel``: ``mappings`` (``f``,
``g`` and their scatter/gather and sequence-parallel relatives), ``layers`` and their autograd
function ``linear_autograd``, ``cross_entropy``, ``data``, ``random`` (RNG streams), ``utils``.
"""
from mpu_lab.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mpu_lab.core.tensor_parallel.data import broadcast_data
from mpu_lab.core.tensor_parallel.layers import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes, set_tensor_model_parallel_attributes)
from mpu_lab.core.tensor_parallel.linear_autograd import (
    LinearWithGradAccumulationAndAsyncCommunication,
    linear_with_grad_accumulation_and_async_allreduce)
from mpu_lab.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region)
from mpu_lab.core.tensor_parallel.random import (
    RNGStatesTracker, checkpoint, get_cuda_rng_tracker, get_rng_tracker,
    model_parallel_cuda_manual_seed, model_parallel_manual_seed)
from mpu_lab.core.tensor_parallel.utils import (
    VocabUtility, divide, ensure_divisibility, gather_split_1d_tensor, split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks)
