"""Column- and row-parallel linear layers and the vocab-parallel embedding.

Shoeybi et al. 2019 (Megatron-LM, §3). In the paper's notation ``Y = X A`` with ``A`` of shape
``(input_size, output_size)``; ``torch.nn.functional.linear`` computes ``X W^T`` so ``W = A^T``
is stored as ``(output_size, input_size)``, like ``torch.nn.Linear``.

* Column parallel: ``A = [A_1, ..., A_t]`` split along its columns (``W`` along dim 0); rank
  ``i`` computes ``Y_i = X A_i``. Needs ``f`` before (the input is used by every rank); as in
  Megatron, f's backward all-reduce runs inside the layer's own autograd function
  (:mod:`~mpu_lab.core.tensor_parallel.linear_autograd`), overlapping the weight-gradient GEMM.
* Row parallel: ``A`` split along its rows (``W`` along dim 1) and ``X = [X_1, ..., X_t]``
  along its last dimension; rank ``i`` computes the partial sum ``X_i A_i``; ``g`` adds them.

Weights are built the way Megatron does on the CPU (``_initialize_affine_weight_cpu``): every
rank creates the *full* master weight with ``init_method`` under the default generator, then
keeps its slice. With the same ``torch.manual_seed`` on every rank, a TP=k shard is exactly a
slice of the TP=1 weight, which is what makes the dense-twin tests possible. The slice is taken
over the *tensor-parallel* group (rank ``tp_rank`` of ``tp_size``), not over the whole world.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from mpu_lab.core import parallel_state, utils
from mpu_lab.core.tensor_parallel.linear_autograd import (
    linear_with_grad_accumulation_and_async_allreduce)
from mpu_lab.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_tensor_model_parallel_region)
from mpu_lab.core.tensor_parallel.utils import VocabUtility, divide

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1,
                                      "partition_stride": 1}


# --------------------------------------------------------------------------- parameter attributes
def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int,
                                         stride: int) -> None:
    """Mark ``tensor`` as split (or not) along ``dim`` with ``stride`` interleaved pieces.

    Checkpointing and gradient clipping read these: a split parameter is counted once per
    rank, a replicated one only once per group (see :func:`param_is_not_tensor_parallel_duplicate`).
    """
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, attribute):
            raise ValueError(f"tensor already has the attribute {attribute!r}")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """True if ``param`` is split across the group, or this is tensor-parallel rank 0."""
    return bool(getattr(param, "tensor_model_parallel", False)) or \
        parallel_state.get_tensor_model_parallel_rank() == 0


# --------------------------------------------------------------------------- weight init
def _per_partition(size: int, what: str, layer: str, stride: int = 1) -> int:
    """``size / t`` for this layer's split dimension, with errors naming the numbers."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(f"{layer} needs the tensor-parallel group: call "
                           f"mpu_lab.core.parallel_state.initialize_model_parallel(...) first (after "
                           f"mpu_lab.training.initialize.init())")
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if size % tp_size:
        raise ValueError(f"{layer}: {what} {size} is not divisible by the tensor-parallel size "
                         f"{tp_size}")
    if stride < 1 or (size // tp_size) % stride:
        raise ValueError(f"{layer}: the per-partition size {size // tp_size} is not divisible by "
                         f"stride {stride}")
    return size // tp_size


def _initialize_affine_weight_cpu(weight: torch.Tensor, output_size: int, input_size: int,
                                  per_partition_size: int, partition_dim: int,
                                  init_method: Callable, stride: int = 1,
                                  return_master_weight: bool = False,
                                  params_dtype: torch.dtype = torch.float32) -> Optional[torch.Tensor]:
    """Build the full ``(output_size, input_size)`` master weight, keep this rank's slice.

    ``stride > 1`` is for weights stored one part after another (Megatron-core's SwiGLU
    ``[W_gate; W_up]`` with ``stride=2``; the 2019 layout ``[Q; K; V]`` with ``stride=3``):
    the master is cut into pieces of ``per_partition_size // stride`` along ``partition_dim``
    and rank ``r`` keeps pieces ``r, r + t, r + 2t, ...`` — its slice of each part.
    """
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    rank, tp_size = parallel_state.get_tensor_model_parallel_rank(), \
        parallel_state.get_tensor_model_parallel_world_size()
    # On the CPU in fp32 under the default generator: the same numbers on every rank and device.
    master_weight = torch.empty(output_size, input_size, dtype=torch.float32, device="cpu",
                                requires_grad=False)   # cpu: the master weight, on purpose
    init_method(master_weight)
    master_weight = master_weight.to(dtype=params_dtype)

    pieces = torch.split(master_weight, divide(per_partition_size, stride), dim=partition_dim)
    mine = pieces[rank::tp_size]  # tensor-parallel rank / size, not the world's
    with torch.no_grad():
        weight.copy_(torch.cat(mine, dim=partition_dim))
    return master_weight if return_master_weight else None


# --------------------------------------------------------------------------- layers
class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A + b`` with ``A`` split along its columns: rank ``i`` holds ``A_i``.

    Input ``[*, input_size]`` (``[s, b, h]`` sequence-first when ``sequence_parallel``, with
    this rank's block ``[s/t, b, h]`` of the sequence). Output ``[*, output_size]`` when
    ``gather_output`` else this rank's ``[*, output_size / t]``. ``forward`` returns
    ``(output, bias)`` where ``bias`` is ``None`` unless ``skip_bias_add`` (then it is not
    added, so the caller can fuse it into the next elementwise op). ``async_comm``: see
    :mod:`~mpu_lab.core.tensor_parallel.linear_autograd` (an attribute, the serial switch).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 gather_output: bool = True, init_method: Callable = torch.nn.init.xavier_normal_,
                 stride: int = 1, keep_master_weight_for_test: bool = False,
                 skip_bias_add: bool = False, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None,
                 gradient_accumulation_fusion: bool = False, async_comm: bool = True):
        super().__init__()
        self.output_size_per_partition = _per_partition(output_size, "output_size",
                                                        "ColumnParallelLinear", stride)
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with "
                             "sequence_parallel=True (the output stays split, as in Megatron)")
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.async_comm = async_comm
        device = device if device is not None else utils.get_device()

        # (output_size / t, input_size): F.linear computes X W^T.
        self.weight = Parameter(torch.empty(self.output_size_per_partition, input_size,
                                            dtype=params_dtype, device=device))
        self.master_weight = _initialize_affine_weight_cpu(
            self.weight, output_size, input_size, self.output_size_per_partition, 0, init_method,
            stride=stride, return_master_weight=keep_master_weight_for_test,
            params_dtype=params_dtype)
        if bias:
            # Megatron: "Always initialize bias to zero." Each rank holds a different slice of
            # the bias: it is split like the weight.
            self.bias = Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype,
                                              device=device))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        # Megatron's linear (linear_autograd) holds f: the sequence-parallel all-gather, or the
        # all-reduce of the input gradient (allreduce_dgrad); one rank communicates nothing.
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        bias = self.bias if not self.skip_bias_add else None
        output_parallel = linear_with_grad_accumulation_and_async_allreduce(   # [*, out/t]
            input_, self.weight, bias, self.gradient_accumulation_fusion,
            allreduce_dgrad=tp_size > 1 and not self.sequence_parallel,
            sequence_parallel=self.sequence_parallel and tp_size > 1, async_comm=self.async_comm)
        output = (gather_from_tensor_model_parallel_region(output_parallel)      # [*, out]
                  if self.gather_output else output_parallel)
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(torch.nn.Module):
    """``Y = X A + b`` with ``A`` split along its rows and ``X`` along its last dimension.

    Input ``[*, input_size]``, or this rank's ``[*, input_size / t]`` when
    ``input_is_parallel`` (the output of a ``ColumnParallelLinear(gather_output=False)``).
    Output ``[*, output_size]`` (``[s/t, b, h]`` with ``sequence_parallel``). The bias is not
    split: it is added once, after the all-reduce.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 input_is_parallel: bool = False,
                 init_method: Callable = torch.nn.init.xavier_normal_, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                 device=None, gradient_accumulation_fusion: bool = False):
        super().__init__()
        self.input_size_per_partition = _per_partition(input_size, "input_size",
                                                       "RowParallelLinear", stride)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs "
                             "input_is_parallel=True (as in Megatron)")
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        device = device if device is not None else utils.get_device()

        # (output_size, input_size / t)
        self.weight = Parameter(torch.empty(output_size, self.input_size_per_partition,
                                            dtype=params_dtype, device=device))
        self.master_weight = _initialize_affine_weight_cpu(
            self.weight, output_size, input_size, self.input_size_per_partition, 1, init_method,
            stride=stride, return_master_weight=keep_master_weight_for_test,
            params_dtype=params_dtype)
        if bias:
            self.bias = Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, False, -1, 1)
            # With sequence parallelism each rank adds the bias to a different block of the
            # sequence, so its gradient differs across the group and must be all-reduced over
            # it before the optimizer step (Megatron marks it the same way).
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_)  # [*, in/t]
        # Megatron's linear too, with nothing to communicate inside it: g comes after
        output_parallel = linear_with_grad_accumulation_and_async_allreduce(   # partial sums
            input_parallel, self.weight, None, self.gradient_accumulation_fusion)
        if self.sequence_parallel:
            output_ = reduce_scatter_to_sequence_parallel_region(output_parallel)  # [s/t, b, out]
        else:
            output_ = reduce_from_tensor_model_parallel_region(output_parallel)  # g
        if self.skip_bias_add:
            return output_, self.bias
        output = output_ + self.bias if self.bias is not None else output_
        return output, None


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split along the vocabulary: rank ``r`` holds rows ``[start, end)``.

    Each rank looks up the ids it owns, writes zeros for the others, and ``g`` (all-reduce)
    adds the partial results: exactly one rank contributes each token's row. Input: token ids
    of any shape; output: ``ids.shape + (embedding_dim,)``. With ``reduce_scatter_embeddings``
    (sequence parallelism) the ids are ``[b, s]``, and the output is transposed to
    sequence-first and reduce-scattered: this rank's ``[s/t, b, h]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 init_method: Callable = torch.nn.init.normal_,
                 keep_master_weight_for_test: bool = False, reduce_scatter_embeddings: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        per_partition = _per_partition(num_embeddings, "num_embeddings (vocab size)",
                                       "VocabParallelEmbedding")
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.tensor_model_parallel_size = tp_size
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, parallel_state.get_tensor_model_parallel_rank(), tp_size)
        self.num_embeddings_per_partition = per_partition
        device = device if device is not None else utils.get_device()

        # (V / t, h)
        self.weight = Parameter(torch.empty(per_partition, embedding_dim, dtype=params_dtype,
                                            device=device))
        self.master_weight = _initialize_affine_weight_cpu(
            self.weight, num_embeddings, embedding_dim, per_partition, 0, init_method,
            return_master_weight=keep_master_weight_for_test, params_dtype=params_dtype)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tensor_model_parallel_size > 1:
            # Ids owned by another rank look up local row 0, then their rows are zeroed.
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        else:
            outside, local_ids = None, input_
        output_parallel = F.embedding(local_ids, self.weight)  # ids.shape + (h,)
        if outside is not None:
            output_parallel = output_parallel.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()  # [s, b, h]
            return reduce_scatter_to_sequence_parallel_region(output_parallel)  # [s/t, b, h]
        return reduce_from_tensor_model_parallel_region(output_parallel)  # g
