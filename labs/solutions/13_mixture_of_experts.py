# Lab 13, "Write the dispatcher": one answer to my_dispatch. Load it on purpose, in a new cell:
#     %load solutions/13_mixture_of_experts.py
# run that cell, then grade it:
#     grader.grade(solution_dispatch, exercises.DISPATCH, world)
# It runs on the ranks, where torch and dist exist.


def solution_dispatch(tokens, routing_map, group):
    ep = dist.get_world_size(group)
    num_experts = routing_map.size(1)
    local = num_experts // ep
    # Permutation 1: one row per (token, expert), expert by expert, each in token order,
    # so the rows for ep rank j (experts j*local ...) are one contiguous block.
    expert_major = routing_map.t()                                     # [E, T]
    token_ids = torch.arange(tokens.size(0), device=tokens.device).expand_as(expert_major)
    permuted = tokens[token_ids[expert_major]]
    # The count exchange: entry j*local + e of what I send is my count for expert e of rank j;
    # entry s*local + e of what I receive is rank s's count for my local expert e.
    counts = routing_map.sum(dim=0).long()                             # [E]
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    per_source = received_counts.reshape(ep, local)                    # [source, local expert]
    input_splits = counts.reshape(ep, local).sum(dim=1).tolist()       # rows to each rank
    output_splits = per_source.sum(dim=1).tolist()                     # rows from each rank
    received = tokens.new_empty((sum(output_splits), tokens.size(1)))
    dist.all_to_all_single(received, permuted.contiguous(), output_splits, input_splits,
                           group=group)
    # Permutation 2: the blocks arrive [source][local expert]; the experts want
    # [local expert][source].
    blocks = received.split(per_source.reshape(-1).tolist())
    rows = torch.cat([blocks[s * local + e] for e in range(local) for s in range(ep)])
    return rows, per_source.sum(dim=0).tolist()
