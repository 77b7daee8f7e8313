# Lab 07, section 6: one answer to my_row_forward. Load it on purpose, in a new cell:
#     %load solutions/07_row_parallel.py
# run that cell, then grade it:
#     grader.grade(solution_row_forward, exercises.row_forward_exercise(input_size, output_size), world)
# It runs on the ranks, where the region functions of section 5 exist.


def solution_row_forward(x, weight, bias, input_is_parallel):
    # whole x: keep this rank's block of columns (the scatter's backward all-gathers the gradient)
    x_i = x if input_is_parallel else scatter_to_tensor_model_parallel_region(x)
    partial = x_i @ weight.t()                             # X_i A_i: full shape, one term of the sum
    y = reduce_from_tensor_model_parallel_region(partial)  # g: the sum over the tensor-parallel group
    return y if bias is None else y + bias                 # the bias once, after the sum


# Lab 07, "Build: RowParallelLinear": one answer, the whole layer. Load it the same way, run the
# cell, then grade it (the grader sends its source to the ranks and defines it there):
#     grader.grade(SolutionRowParallelLinear, build.ROW_PARALLEL_LINEAR, world)
# It uses only names every rank has (torch, parallel_state, the region functions), and imports
# get_device where it needs it, so it also runs from my_megatron/layers.py.
import torch


class SolutionRowParallelLinear(torch.nn.Module):
    """Y = X A + b with A cut by rows: this rank keeps W_i = A_i^T, its in/t columns of W."""

    def __init__(self, input_size, output_size, bias=True, input_is_parallel=False,
                 init_method=torch.nn.init.xavier_normal_, skip_bias_add=False,
                 sequence_parallel=False, params_dtype=torch.float32, **unused):
        super().__init__()
        from mpu_lab.core.utils import get_device                # this rank's device
        t = parallel_state.get_tensor_model_parallel_world_size()
        r = parallel_state.get_tensor_model_parallel_rank()
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel
        master = torch.empty(output_size, input_size, dtype=torch.float32)  # W = A^T, on the CPU
        init_method(master)                                      # the same numbers on every rank
        mine = master.chunk(t, dim=1)[r]                         # columns r*in/t .. (r+1)*in/t
        self.weight = torch.nn.Parameter(mine.to(get_device(), params_dtype).contiguous())
        self.bias = torch.nn.Parameter(torch.zeros(                # whole: added once, after g
            output_size, dtype=params_dtype, device=get_device())) if bias else None
        if self.bias is not None:
            self.bias.sequence_parallel = sequence_parallel      # its gradient: a partial sum

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x)       # X_i; backward all-gathers
        y = torch.nn.functional.linear(x, self.weight)           # X_i A_i: one term of the sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y)    # [s, b, h] -> [s/t, b, h]
        else:
            y = reduce_from_tensor_model_parallel_region(y)      # g: the sum over the group
        if self.skip_bias_add:
            return y, self.bias
        return (y if self.bias is None else y + self.bias), None
