# Lab 08, "Write f and g yourself": one answer to f_forward, f_backward, g_forward and
# g_backward. Load it on purpose, in a new cell:
#     %load solutions/08_tp_mappings.py
# run that cell, then grade it:
#     grader.grade((solution_f_forward, solution_f_backward), exercises.F_EXERCISE, world)
#     grader.grade((solution_g_forward, solution_g_backward), exercises.G_EXERCISE, world)
# They run on the ranks, where dist and parallel_state exist.


def solution_f_forward(x):
    return x          # every rank of the group already holds the same x


def solution_f_backward(grad):
    # each rank holds only its part of x's gradient: add them up over the tensor-parallel group
    dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
    return grad


def solution_g_forward(x):
    out = x.clone()   # each rank holds a partial sum: add them up over the tensor-parallel group
    dist.all_reduce(out, group=parallel_state.get_tensor_model_parallel_group())
    return out


def solution_g_backward(grad):
    return grad       # the gradient of the summed output is the same on every rank


# Lab 08, "Build: the mappings": one answer, the seven operators as Megatron-core's
# tensor_parallel/mappings.py has them. Load it the same way, run the cell, then grade them:
#     grader.grade((solution_copy_to_tensor_model_parallel_region,
#                   solution_reduce_from_tensor_model_parallel_region,
#                   solution_scatter_to_tensor_model_parallel_region,
#                   solution_gather_from_tensor_model_parallel_region), build.TP_MAPPINGS, world)
#     grader.grade((solution_scatter_to_sequence_parallel_region,
#                   solution_gather_from_sequence_parallel_region,
#                   solution_reduce_scatter_to_sequence_parallel_region), build.SP_MAPPINGS, world)
# Each autograd Function is defined inside its function: a function typed in a notebook travels
# to the ranks and a class does not. They use only torch, dist and parallel_state, so they also
# run from my_megatron/mappings.py.
def solution_copy_to_tensor_model_parallel_region(x):
    class Copy(torch.autograd.Function):                      # f
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):                               # the ranks' partial dL/dX, summed
            grad = grad.clone()
            dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
            return grad
    return Copy.apply(x)


def solution_reduce_from_tensor_model_parallel_region(x):
    class Reduce(torch.autograd.Function):                    # g
        @staticmethod
        def forward(ctx, x):
            out = x.clone()
            dist.all_reduce(out, group=parallel_state.get_tensor_model_parallel_group())
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad
    return Reduce.apply(x)


def solution_scatter_to_tensor_model_parallel_region(x):
    group = parallel_state.get_tensor_model_parallel_group()
    t = parallel_state.get_tensor_model_parallel_world_size()
    r = parallel_state.get_tensor_model_parallel_rank()

    class Scatter(torch.autograd.Function):                   # keep this rank's last-dim block
        @staticmethod
        def forward(ctx, x):
            return x.chunk(t, dim=-1)[r].contiguous()

        @staticmethod
        def backward(ctx, grad):
            parts = [torch.empty_like(grad) for _ in range(t)]
            dist.all_gather(parts, grad.contiguous(), group=group)
            return torch.cat(parts, dim=-1)
    return Scatter.apply(x)


def solution_gather_from_tensor_model_parallel_region(x):
    group = parallel_state.get_tensor_model_parallel_group()
    t = parallel_state.get_tensor_model_parallel_world_size()
    r = parallel_state.get_tensor_model_parallel_rank()

    class Gather(torch.autograd.Function):                    # concatenate the last-dim blocks
        @staticmethod
        def forward(ctx, x):
            parts = [torch.empty_like(x) for _ in range(t)]
            dist.all_gather(parts, x.contiguous(), group=group)
            return torch.cat(parts, dim=-1)

        @staticmethod
        def backward(ctx, grad):
            return grad.chunk(t, dim=-1)[r].contiguous()
    return Gather.apply(x)


def solution_scatter_to_sequence_parallel_region(x):
    group = parallel_state.get_tensor_model_parallel_group()
    t = parallel_state.get_tensor_model_parallel_world_size()
    r = parallel_state.get_tensor_model_parallel_rank()

    class ScatterSequence(torch.autograd.Function):           # [s, b, h] -> this rank's [s/t, b, h]
        @staticmethod
        def forward(ctx, x):
            return x.chunk(t, dim=0)[r].contiguous()

        @staticmethod
        def backward(ctx, grad):
            parts = [torch.empty_like(grad) for _ in range(t)]
            dist.all_gather(parts, grad.contiguous(), group=group)
            return torch.cat(parts, dim=0)
    return ScatterSequence.apply(x)


def solution_gather_from_sequence_parallel_region(x):
    group = parallel_state.get_tensor_model_parallel_group()
    t = parallel_state.get_tensor_model_parallel_world_size()
    r = parallel_state.get_tensor_model_parallel_rank()

    class GatherSequence(torch.autograd.Function):            # sequence parallelism's f
        @staticmethod
        def forward(ctx, x):
            parts = [torch.empty_like(x) for _ in range(t)]
            dist.all_gather(parts, x.contiguous(), group=group)
            return torch.cat(parts, dim=0)

        @staticmethod
        def backward(ctx, grad):                               # sum the partials, keep my block
            total = grad.clone()       # a reduce-scatter (gloo has none: the sum, then the block)
            dist.all_reduce(total, group=group)
            return total.chunk(t, dim=0)[r].contiguous()
    return GatherSequence.apply(x)


def solution_reduce_scatter_to_sequence_parallel_region(x):
    group = parallel_state.get_tensor_model_parallel_group()
    t = parallel_state.get_tensor_model_parallel_world_size()
    r = parallel_state.get_tensor_model_parallel_rank()

    class ReduceScatterSequence(torch.autograd.Function):     # sequence parallelism's g
        @staticmethod
        def forward(ctx, x):
            total = x.clone()          # a reduce-scatter (gloo has none: the sum, then the block)
            dist.all_reduce(total, group=group)
            return total.chunk(t, dim=0)[r].contiguous()

        @staticmethod
        def backward(ctx, grad):
            parts = [torch.empty_like(grad) for _ in range(t)]
            dist.all_gather(parts, grad.contiguous(), group=group)
            return torch.cat(parts, dim=0)
    return ReduceScatterSequence.apply(x)
