# Lab 04: answers to the write-the-code exercises. Load them on purpose, in a new cell:
#     %load solutions/04_data_parallel.py
# run that cell, then grade one:
#     exercises.grade(solution_grad_ready_hook, dp_exercises.BUCKET_HOOK, world)
#     exercises.grade(solution_distributed_step, exercises.DISTRIBUTED_STEP, world)
# They run on the ranks, where torch and dist exist.


def solution_grad_ready_hook(param, state):
    state.counts[param] += 1                       # one more micro-batch's gradient is in
    bucket = state.bucket_of(param)
    if all(state.counts[p] == state.num_micro_batches for p in bucket.params):
        # the whole bucket is final: reduce it while backward goes on with earlier layers
        state.pending[bucket.index] = dist.all_reduce(bucket.grad_data, group=state.group,
                                                      async_op=True)


def solution_distributed_step(param, grad, lr, group):
    d, me, n = dist.get_world_size(group), dist.get_rank(group), param.numel()
    size = -(-n // d)                                   # each rank's shard, after padding
    pad, shard_grad = grad.new_zeros(size * d - n), grad.new_empty(size)
    dist.reduce_scatter_tensor(shard_grad, torch.cat([grad, pad]), group=group)   # sum of my shard
    shard = torch.cat([param, pad])[me * size:(me + 1) * size] - lr * shard_grad / d
    full = torch.empty(size * d, dtype=param.dtype, device=param.device)
    dist.all_gather_into_tensor(full, shard, group=group)
    return full[:n]
