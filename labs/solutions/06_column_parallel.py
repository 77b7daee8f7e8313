# Lab 06, section 8: one answer to my_column_forward. Load it on purpose, in a new cell:
#     %load solutions/06_column_parallel.py
# run that cell, then grade it:
#     exercises.grade(solution_column_forward, exercises.column_parallel.COLUMN_FORWARD, world)
# It runs on the ranks, where copy_to_... and gather_from_tensor_model_parallel_region exist.


def solution_column_forward(x, weight_shard, bias_shard, gather_output):
    x = copy_to_tensor_model_parallel_region(x)               # f: identity; backward all-reduces dL/dX
    y_i = torch.matmul(x, weight_shard.t()) + bias_shard      # Y_i = X A_i + b_i: [..., out/t]
    if gather_output:
        return gather_from_tensor_model_parallel_region(y_i)  # all-gather along the last dim: [..., out]
    return y_i
