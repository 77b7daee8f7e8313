# Lab 09, the vocabulary-parallel cross-entropy: one answer to my_vocab_parallel_ce and one to
# my_vocab_parallel_ce_backward. Load it on purpose, in a new cell:
#     %load solutions/09_parallel_transformer.py
# run that cell, then grade them:
#     exercises.grade(solution_vocab_parallel_ce, exercises.parallel_transformer.VOCAB_PARALLEL_CE, world)
#     exercises.grade(solution_vocab_parallel_ce_backward,
#                     exercises.parallel_transformer.VOCAB_PARALLEL_CE_BACKWARD, world)
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
