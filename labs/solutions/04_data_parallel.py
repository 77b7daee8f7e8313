# Lab 04: answers to the write-the-code exercises. Load them on purpose, in a new cell:
#     %load solutions/04_data_parallel.py
# run that cell, then grade one:
#     grader.grade(solution_grad_ready_hook, exercises.BUCKET_HOOK, world)
#     grader.grade(solution_distributed_step, exercises.DISTRIBUTED_STEP, world)
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


# The builds (whole pieces of your own Megatron): grade them with
#     grader.grade(SolutionDistributedDataParallel, dp_build.DDP_BUILD, world)
#     grader.grade(SolutionDistributedOptimizer, dp_build.OPTIMIZER_BUILD, world)
class SolutionDistributedDataParallel:
    def __init__(self, module, data_parallel_group=None, bucket_size=40_000,
                 num_micro_batches=1):
        self.module, self.group = module, data_parallel_group
        self.size = dist.get_world_size(group=data_parallel_group)
        self.num_micro_batches = num_micro_batches
        # buckets in reverse order: the order the gradients are ready in backward
        self.buckets, current, filled = [], [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            current.append(p)
            filled += p.numel()
            if filled >= bucket_size:                  # Megatron's rule: close at >= size
                self.buckets.append(current)
                current, filled = [], 0
        if current:
            self.buckets.append(current)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        for b in self.buckets:
            for p in b:
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self.zero_grad_buffer()

    def zero_grad_buffer(self):
        for b in self.buckets:
            for p in b:
                p.grad = None
        self.counts = {id(p): 0 for b in self.buckets for p in b}
        self.pending = {}                              # bucket index -> (handle, flat sum)

    def _grad_ready(self, param):
        self.counts[id(param)] += 1
        i = self.bucket_of[id(param)]
        if all(self.counts[id(p)] == self.num_micro_batches for p in self.buckets[i]):
            self._start(i)                             # reduced while backward goes on

    def _start(self, i):
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.buckets[i]])
        self.pending[i] = (dist.all_reduce(flat, group=self.group, async_op=True), flat)

    def finish_grad_sync(self):
        for i in range(len(self.buckets)):
            if i not in self.pending:                  # a bucket with a gradient-less parameter
                self._start(i)
        for i, (handle, flat) in sorted(self.pending.items()):
            handle.wait()
            flat /= self.size
            offset = 0
            for p in self.buckets[i]:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()


class SolutionDistributedOptimizer:
    def __init__(self, params, data_parallel_group=None, lr=1e-3, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0.0):
        self.params = [p for p in params if p.requires_grad]
        self.group = data_parallel_group
        self.size = dist.get_world_size(group=data_parallel_group)
        self.rank = dist.get_rank(group=data_parallel_group)
        total = sum(p.numel() for p in self.params)
        self.shard_size = -(-total // self.size)                  # padded to a multiple of d
        flat = self._flat([p.detach() for p in self.params])
        start = self.rank * self.shard_size
        self.shard = torch.nn.Parameter(flat[start:start + self.shard_size].clone())
        # Adam's m and v exist for this rank's shard only: 1/d of the state
        self.optimizer = torch.optim.AdamW([self.shard], lr=lr, betas=betas, eps=eps,
                                           weight_decay=weight_decay)

    def _flat(self, tensors):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(flat, (0, self.shard_size * self.size - flat.numel()))

    def step(self):
        grads = self._flat([p.grad if p.grad is not None else torch.zeros_like(p)
                            for p in self.params])
        grad_shard = grads.new_empty(self.shard_size)
        dist.reduce_scatter_tensor(grad_shard, grads, group=self.group)   # my shard's sum
        self.shard.grad = grad_shard / self.size
        self.optimizer.step()
        full = self.shard.data.new_empty(self.shard_size * self.size)
        dist.all_gather_into_tensor(full, self.shard.data, group=self.group)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
