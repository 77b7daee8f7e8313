# Lab 06, section 8: one answer to my_column_forward. Load it on purpose, in a new cell:
#     %load solutions/06_column_parallel.py
# run that cell, then grade it:
#     grader.grade(solution_column_forward, exercises.COLUMN_FORWARD, world)
# It runs on the ranks, where copy_to_... and gather_from_tensor_model_parallel_region exist.


def solution_column_forward(x, weight_shard, bias_shard, gather_output):
    x = copy_to_tensor_model_parallel_region(x)               # f: identity; backward all-reduces dL/dX
    y_i = torch.matmul(x, weight_shard.t()) + bias_shard      # Y_i = X A_i + b_i: [..., out/t]
    if gather_output:
        return gather_from_tensor_model_parallel_region(y_i)  # all-gather along the last dim: [..., out]
    return y_i


# Lab 06, "Build: ColumnParallelLinear": one answer, the whole layer. Load it the same way, run
# the cell, then grade it (the grader sends its source to the ranks and defines it there):
#     grader.grade(SolutionColumnParallelLinear, build.COLUMN_PARALLEL_LINEAR, world)
# It uses only names every rank has (torch, parallel_state, the region functions), and imports
# get_device where it needs it, so it also runs from my_megatron/layers.py.
import torch


class SolutionColumnParallelLinear(torch.nn.Module):
    """Y = X A + b with A cut by columns: this rank keeps W_i = A_i^T, its out/t rows of W."""

    def __init__(self, input_size, output_size, bias=True, gather_output=True,
                 init_method=torch.nn.init.xavier_normal_, skip_bias_add=False,
                 sequence_parallel=False, params_dtype=torch.float32, **unused):
        super().__init__()
        from mpu_lab.core.utils import get_device                # this rank's device
        t = parallel_state.get_tensor_model_parallel_world_size()
        r = parallel_state.get_tensor_model_parallel_rank()
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel
        master = torch.empty(output_size, input_size, dtype=torch.float32)  # W = A^T, on the CPU
        init_method(master)                                      # the same numbers on every rank
        mine = master.chunk(t, dim=0)[r]                         # rows r*out/t .. (r+1)*out/t
        self.weight = torch.nn.Parameter(mine.to(get_device(), params_dtype).contiguous())
        self.bias = torch.nn.Parameter(torch.zeros(
            output_size // t, dtype=params_dtype, device=get_device())) if bias else None

    def forward(self, x):
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x)          # [s/t, b, h] -> [s, b, h]
        else:
            x = copy_to_tensor_model_parallel_region(x)          # f: backward all-reduces dL/dX
        y = torch.nn.functional.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y)      # [..., out/t] -> [..., out]
        return y, (self.bias if self.skip_bias_add else None)
