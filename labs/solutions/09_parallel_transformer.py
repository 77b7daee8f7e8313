# Lab 09, the vocabulary-parallel cross-entropy: one answer to my_vocab_parallel_ce and one to
# my_vocab_parallel_ce_backward. Load it on purpose, in a new cell:
#     %load solutions/09_parallel_transformer.py
# run that cell, then grade them:
#     grader.grade(solution_vocab_parallel_ce, exercises.VOCAB_PARALLEL_CE, world)
#     grader.grade(solution_vocab_parallel_ce_backward,
#                     exercises.VOCAB_PARALLEL_CE_BACKWARD, world)
# It runs on the ranks, where torch, dist and parallel_state exist.


def solution_vocab_parallel_ce(logits_shard, target, vocab_start, vocab_end):
    group = parallel_state.get_tensor_model_parallel_group()
    row_max = logits_shard.max(dim=1).values
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)      # 1. M, over all V ids
    mine = torch.arange(vocab_start, vocab_end, device=target.device) == target[:, None]
    target_logit = (logits_shard * mine).sum(dim=1)                   # 0 unless this rank holds y
    dist.all_reduce(target_logit, group=group)                        # 2. z_y
    sum_exp = (logits_shard - row_max[:, None]).exp().sum(dim=1)
    dist.all_reduce(sum_exp, group=group)                             # 3. the sum of e^(z - M)
    return sum_exp.log() + row_max - target_logit


def solution_vocab_parallel_ce_backward(softmax_shard, target, vocab_start, vocab_end, grad_output):
    # d(loss)/dz = softmax(z) - onehot(y). The 1 of the one-hot sits in one rank's slice only:
    # that rank subtracts it, the others have nothing to subtract. No communication: the
    # forward's all-reduces already made every rank's softmax slice global.
    grad = softmax_shard.clone()
    mine = (target >= vocab_start) & (target < vocab_end)
    rows = torch.arange(len(target), device=target.device)[mine]
    grad[rows, target[mine] - vocab_start] -= 1.0
    return grad * grad_output[:, None]


# Lab 09, "Build: the vocabulary-parallel embedding and loss": one answer to each whole piece. Load it the
# same way, run the cell, then grade them (a class travels to the ranks as its source):
#     grader.grade(SolutionVocabParallelEmbedding, build.VOCAB_PARALLEL_EMBEDDING, world)
#     grader.grade(solution_vocab_parallel_cross_entropy, build.VOCAB_PARALLEL_CROSS_ENTROPY, world)
# They use only torch, dist, parallel_state and reduce_from_tensor_model_parallel_region, and
# import get_device where they need it, so they also run from my_megatron/.
import torch


class SolutionVocabParallelEmbedding(torch.nn.Module):
    """The table split along the vocabulary: this rank looks up the ids it owns, zeros for the
    others, and g adds the ranks' rows."""

    def __init__(self, num_embeddings, embedding_dim, init_method=torch.nn.init.normal_,
                 params_dtype=torch.float32, **unused):
        super().__init__()
        from mpu_lab.core.utils import get_device                # this rank's device
        t = parallel_state.get_tensor_model_parallel_world_size()
        r = parallel_state.get_tensor_model_parallel_rank()
        per_rank = num_embeddings // t
        self.vocab_start_index, self.vocab_end_index = r * per_rank, (r + 1) * per_rank
        master = torch.empty(num_embeddings, embedding_dim, dtype=torch.float32)  # on the CPU
        init_method(master)                                      # the same numbers on every rank
        mine = master[self.vocab_start_index:self.vocab_end_index]
        self.weight = torch.nn.Parameter(mine.to(get_device(), params_dtype).contiguous())

    def forward(self, ids):
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        rows = torch.nn.functional.embedding(local, self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)      # another rank's ids: zeros
        return reduce_from_tensor_model_parallel_region(rows)     # g: each row from one rank


def solution_vocab_parallel_cross_entropy(vocab_parallel_logits, target):
    group = parallel_state.get_tensor_model_parallel_group()
    r = parallel_state.get_tensor_model_parallel_rank()

    class VocabParallelCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, target):
            per_rank = logits.size(-1)                           # [*, V/t], ids [r V/t, (r+1) V/t)
            start = r * per_rank
            row_max = logits.max(dim=-1).values
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)      # 1. the max
            logits = logits - row_max.unsqueeze(-1)
            not_mine = (target < start) | (target >= start + per_rank)
            local = (target - start).masked_fill(not_mine, 0)
            picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(not_mine, 0.0)
            dist.all_reduce(picked, group=group)                              # 2. target logit
            exp = logits.exp()
            sum_exp = exp.sum(dim=-1)
            dist.all_reduce(sum_exp, group=group)                             # 3. the sum of exp
            ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), not_mine, local)
            return sum_exp.log() - picked

        @staticmethod
        def backward(ctx, grad_output):          # softmax - one-hot: no communication
            softmax, not_mine, local = ctx.saved_tensors
            onehot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1), 1.0)
            onehot = onehot * (~not_mine).unsqueeze(-1).to(softmax.dtype)
            return (softmax - onehot) * grad_output.unsqueeze(-1), None

    return VocabParallelCrossEntropy.apply(vocab_parallel_logits, target)
