"""Cross entropy over logits that are split along the vocabulary (Megatron-LM §3, "Input and
output embedding": fuse the output GEMM with the loss so the ``[b, s, V]`` logits are never
all-gathered — each rank communicates only ``b * s`` scalars).

Rank ``r`` holds the logits of vocabulary ids ``[r * V/t, (r + 1) * V/t)``. Megatron's recipe:

1. all-reduce MAX of the per-rank maxima, subtract it (a stable softmax);
2. the target logit lives on one rank: every rank picks it where it owns the target, writes 0
   elsewhere, all-reduce SUM;
3. all-reduce SUM of the per-rank sums of ``exp``;
4. loss = ``log(sum_exp) - target_logit``.

Backward needs no communication: ``d loss / d logits = softmax - onehot`` on the local slice.

Label smoothing follows torch's ``F.cross_entropy``: ``q = (1 - eps) onehot + eps / V``, so
``loss = (1 - eps) * nll - eps * mean_v log p_v``, the mean over the whole vocabulary (one more
all-reduce SUM); it matches torch at any tensor-parallel size. Megatron-core rescales ``eps`` to
``eps * K / (K - 1)`` and means ``log p`` over the local partition only (``K = V/t``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mpu_lab.core import comm, parallel_state
from mpu_lab.core.tensor_parallel.utils import VocabUtility


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0):
        # vocab_parallel_logits: [*, V/t]; target: [*] global vocabulary ids.
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        group = parallel_state.get_tensor_model_parallel_group()
        rank = parallel_state.get_tensor_model_parallel_rank()
        world = parallel_state.get_tensor_model_parallel_world_size()

        # 1. Global max per token, for a stable exp.
        logits_max = vocab_parallel_logits.max(dim=-1)[0]                      # [*]
        logits_max = comm.all_reduce(logits_max, group=group, op=dist.ReduceOp.MAX)
        logits = vocab_parallel_logits - logits_max.unsqueeze(-1)              # [*, V/t]

        # 2. The target logit, from the rank that owns the target id.
        partition_vocab_size = logits.size(-1)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, rank, world)
        target_mask = (target < start) | (target >= end)                      # [*] not mine
        masked_target = (target - start).masked_fill(target_mask, 0)
        logits_2d = logits.reshape(-1, partition_vocab_size)                  # [N, V/t]
        masked_target_1d = masked_target.reshape(-1)                          # [N]
        rows = torch.arange(logits_2d.size(0), device=logits_2d.device)
        predicted_logits = logits_2d[rows, masked_target_1d].view_as(target)
        predicted_logits = predicted_logits.masked_fill(target_mask, 0.0)
        predicted_logits = comm.all_reduce(predicted_logits, group=group)     # [*]

        # 3. The softmax denominator.
        exp_logits = logits.exp()                                             # [*, V/t]
        sum_exp_logits = comm.all_reduce(exp_logits.sum(dim=-1), group=group)  # [*]

        # 4. -log softmax at the target.
        log_sum_exp = sum_exp_logits.log()
        loss = log_sum_exp - predicted_logits                                 # [*]

        vocab_size = partition_vocab_size * world
        if label_smoothing > 0:
            # -mean_v log p_v = log_sum_exp - mean_v(shifted logit), over the whole vocabulary.
            sum_logits = comm.all_reduce(logits.sum(dim=-1), group=group)     # [*]
            smooth_loss = log_sum_exp - sum_logits / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth_loss

        softmax = exp_logits / sum_exp_logits.unsqueeze(-1)                   # [*, V/t]
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        eps, vocab_size = ctx.label_smoothing, ctx.vocab_size
        # d loss / d logits = softmax - q, with q = (1 - eps) onehot + eps / V.
        grad_input = softmax.clone()
        grad_2d = grad_input.view(-1, softmax.size(-1))                       # [N, V/t]
        rows = torch.arange(grad_2d.size(0), device=grad_2d.device)
        owned = (~target_mask).reshape(-1).to(grad_2d.dtype)                  # 1 where mine
        grad_2d[rows, masked_target_1d] -= (1.0 - eps) * owned
        if eps > 0:
            grad_2d -= eps / vocab_size
        grad_input.mul_(grad_output.unsqueeze(-1))
        return grad_input, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token cross entropy (shape of ``target``) of logits split along the vocabulary.

    ``vocab_parallel_logits``: ``[*, V/t]``, this rank's slice (e.g. ``[s, b, V/t]``);
    ``target``: ``[*]`` global ids. Equals
    ``F.cross_entropy(full_logits.view(-1, V), target.view(-1), reduction="none",
    label_smoothing=label_smoothing).view_as(target)`` (see the module docstring for how this
    label smoothing differs from Megatron-core's).
    """
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing)
