"""The learner's distributed optimizer step (ZeRO-1: Rajbhandari et al. 2020, §5.1;
Megatron-core's ``optimizer/distrib_optimizer.py``): each data-parallel rank keeps the AdamW
state of one shard of the flattened parameters only. A step reduce-scatters the gradients
(each rank gets the average of its shard), runs AdamW on its shard, and all-gathers the updated
shards so every rank holds all the parameters again."""
import torch
import torch.distributed as dist

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DistributedOptimizer:
    def __init__(self, params, data_parallel_group=None, lr=1e-3, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0.0):
        self.params = [p for p in params if p.requires_grad]
        self.group = data_parallel_group
        self.size = dist.get_world_size(group=data_parallel_group)
        self.rank = dist.get_rank(group=data_parallel_group)
        total = sum(p.numel() for p in self.params)
        self.shard_size = -(-total // self.size)
        flat = self._flat([p.detach() for p in self.params])
        start = self.rank * self.shard_size
        self.shard = torch.nn.Parameter(flat[start:start + self.shard_size].clone())
        self.optimizer = torch.optim.AdamW([self.shard], lr=lr, betas=betas, eps=eps,
                                           weight_decay=weight_decay)

    def _flat(self, tensors):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(flat, (0, self.shard_size * self.size - flat.numel()))

    def step(self):
        grads = self._flat([p.grad if p.grad is not None else torch.zeros_like(p)
                            for p in self.params])
        grad_shard = torch.empty(self.shard_size, dtype=grads.dtype, device=grads.device)
        _reduce_scatter(grad_shard, grads, group=self.group)
        self.shard.grad = grad_shard / self.size
        self.optimizer.step()
        shards = [torch.empty_like(self.shard.data) for _ in range(self.size)]
        dist.all_gather(shards, self.shard.data, group=self.group)
        flat, offset = torch.cat(shards), 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
