"""The learner's ``vocab_parallel_cross_entropy`` (Shoeybi et al. 2019, §3, "Input and output
embedding"; Megatron-core's ``tensor_parallel/cross_entropy.py``): the loss of logits split
along the vocabulary, with all-reduces of one number per token (max, target logit, sum of
exponentials) instead of an all-gather of ``[*, V]`` logits."""
import torch
import torch.distributed as dist

from mpu_lab.core.parallel_state import (get_tensor_model_parallel_group,
                                         get_tensor_model_parallel_rank,
                                         get_tensor_model_parallel_world_size)


def _sum(x, op=dist.ReduceOp.SUM):
    if get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(x, op=op, group=get_tensor_model_parallel_group())
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):
        # logits: [*, V/t] this rank's slice; target: [*] ids in the whole vocabulary
        logits = logits - _sum(logits.max(dim=-1)[0], dist.ReduceOp.MAX).unsqueeze(-1)
        per_rank = logits.size(-1)
        start = get_tensor_model_parallel_rank() * per_rank
        not_mine = (target < start) | (target >= start + per_rank)
        local = (target - start).masked_fill(not_mine, 0)
        target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        target_logit = _sum(target_logit.masked_fill(not_mine, 0.0))
        exp = logits.exp()
        sum_exp = _sum(exp.sum(dim=-1))
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), not_mine, local)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, not_mine, local = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1), 1.0)
        onehot = onehot * (~not_mine).unsqueeze(-1).to(softmax.dtype)
        return (softmax - onehot) * grad.unsqueeze(-1), None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target):
    """Per-token loss, the shape of ``target``."""
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target)
