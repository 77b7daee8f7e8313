"""The learner's data parallelism with buckets, gradient hooks and overlapped asynchronous
all-reduces (Li et al. 2020, PyTorch DDP §3.2; Megatron-core's
``distributed/distributed_data_parallel.py``).

The parameters are packed into buckets of about ``bucket_size`` elements in reverse order (the
order their gradients are ready in backward). A hook on each parameter counts its gradients;
when every parameter of a bucket has had its last one (``num_micro_batches`` per step), the
bucket's gradients are flattened and all-reduced asynchronously while backward goes on.
``finish_grad_sync()`` waits for the reductions and writes the averages back to ``.grad``.
"""
import torch
import torch.distributed as dist


class DistributedDataParallel(torch.nn.Module):
    def __init__(self, module, data_parallel_group=None, bucket_size=40_000, num_micro_batches=1):
        super().__init__()
        self.module, self.group = module, data_parallel_group
        self.size = dist.get_world_size(group=data_parallel_group)
        self.num_micro_batches = num_micro_batches
        self.buckets, current, filled = [], [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            current.append(p)
            filled += p.numel()
            if filled >= bucket_size:
                self.buckets.append(current)
                current, filled = [], 0
        if current:
            self.buckets.append(current)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)
        self.zero_grad_buffer()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self):
        for p in self.module.parameters():
            p.grad = None
        self.counts = {id(p): 0 for b in self.buckets for p in b}
        self.pending = {}                  # bucket index -> (work, flat gradients)

    def _hook(self, param):
        self.counts[id(param)] += 1
        i = self.bucket_of[id(param)]
        if all(self.counts[id(p)] == self.num_micro_batches for p in self.buckets[i]):
            self._start(i)

    def _start(self, i):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.pending[i] = (dist.all_reduce(flat, group=self.group, async_op=True), flat)

    def finish_grad_sync(self):
        for i in range(len(self.buckets)):
            if i not in self.pending:
                self._start(i)
        for i, (work, flat) in self.pending.items():
            work.wait()
            flat /= self.size
            offset = 0
            for p in self.buckets[i]:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
