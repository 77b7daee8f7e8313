"""The learner's tensor-parallel layers: :class:`ColumnParallelLinear`,
:class:`RowParallelLinear` and :class:`VocabParallelEmbedding` (Shoeybi et al. 2019, §3;
Megatron-core's ``tensor_parallel/layers.py``), written on the learner's own f and g
(``mappings.py``).

Each rank builds the whole master weight on the CPU with ``init_method`` (the same numbers on
every rank from the same seed) and keeps its slice along the split dimension: rows of
``W`` (``[out, in]``) for the column-parallel layer and the vocabulary, columns for the
row-parallel one. They take the keyword arguments the mirror's layer specs pass
(``mpu_lab.core.models.gpt.gpt_layer_specs``) and return ``(output, bias_or_None)``.
"""
import torch
import torch.nn.functional as F

from mpu_lab.core.parallel_state import (get_tensor_model_parallel_rank,
                                         get_tensor_model_parallel_world_size)
from mpu_lab.core.utils import get_device

from .mappings import (copy_to_tensor_model_parallel_region,
                       gather_from_sequence_parallel_region,
                       gather_from_tensor_model_parallel_region,
                       reduce_from_tensor_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region,
                       scatter_to_tensor_model_parallel_region)


def _my_slice(rows, cols, init_method, dim, params_dtype):
    """The full master weight ``[rows, cols]``, built on the CPU, and this rank's slice of it."""
    t, r = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    master = torch.empty(rows, cols, dtype=torch.float32)
    init_method(master)
    mine = master.chunk(t, dim=dim)[r].to(dtype=params_dtype, device=get_device())
    return torch.nn.Parameter(mine.contiguous())


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A + b``, ``A`` split by columns: rank ``r`` computes ``Y_r = f(X) A_r``."""

    def __init__(self, input_size, output_size, bias=True, gather_output=True,
                 init_method=torch.nn.init.xavier_normal_, skip_bias_add=False,
                 sequence_parallel=False, params_dtype=torch.float32, **unused):
        super().__init__()
        t = get_tensor_model_parallel_world_size()
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.weight = _my_slice(output_size, input_size, init_method, 0, params_dtype)
        self.bias = torch.nn.Parameter(torch.zeros(output_size // t, dtype=params_dtype,
                                                   device=get_device())) if bias else None

    def forward(self, x):
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x)       # [s/t, b, h] -> [s, b, h]
        else:
            x = copy_to_tensor_model_parallel_region(x)       # f
        y = F.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y)
        return y, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(torch.nn.Module):
    """``Y = X A + b``, ``A`` split by rows: rank ``r`` computes ``X_r A_r``, g sums them."""

    def __init__(self, input_size, output_size, bias=True, input_is_parallel=False,
                 init_method=torch.nn.init.xavier_normal_, skip_bias_add=False,
                 sequence_parallel=False, params_dtype=torch.float32, **unused):
        super().__init__()
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.weight = _my_slice(output_size, input_size, init_method, 1, params_dtype)
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=params_dtype,
                                                   device=get_device())) if bias else None
        if self.bias is not None:
            self.bias.sequence_parallel = sequence_parallel   # its gradient is a partial sum

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x)
        y = F.linear(x, self.weight)                          # this rank's partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y)
        else:
            y = reduce_from_tensor_model_parallel_region(y)   # g
        if self.skip_bias_add:
            return y, self.bias
        return (y + self.bias if self.bias is not None else y), None


class VocabParallelEmbedding(torch.nn.Module):
    """The embedding table split along the vocabulary: rank ``r`` looks up the ids it owns,
    zeros for the others, and g adds the ranks' rows."""

    def __init__(self, num_embeddings, embedding_dim, init_method=torch.nn.init.normal_,
                 params_dtype=torch.float32, **unused):
        super().__init__()
        t, r = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        per_rank = num_embeddings // t
        self.vocab_start_index, self.vocab_end_index = r * per_rank, (r + 1) * per_rank
        self.weight = _my_slice(num_embeddings, embedding_dim, init_method, 0, params_dtype)

    def forward(self, ids):
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(rows)
