# Lab 02, section 5: one answer to my_ring_all_reduce. Load it on purpose, in a new cell:
#     %load solutions/02_collectives.py
# run that cell, then grade it:
#     grader.grade(solution_ring_all_reduce, exercises.RING_ALL_REDUCE, world)
# It runs on the ranks, where torch, dist and comm exist.


def solution_ring_all_reduce(x, group):
    n, me = dist.get_world_size(group), dist.get_rank(group)
    flat = x.reshape(-1)
    size = -(-flat.numel() // n)                        # chunk length, after padding
    chunks = list(torch.cat([flat, flat.new_zeros(size * n - flat.numel())]).split(size))
    right, left = (me + 1) % n, (me - 1) % n
    for step in range(n - 1):       # reduce-scatter: add what the left neighbour has summed so far
        send, recv = (me - step) % n, (me - step - 1) % n
        chunks[recv] = chunks[recv] + comm.exchange.send_recv(chunks[send], right, left, group)
    for step in range(n - 1):       # all-gather: chunk (me + 1) % n is complete here; pass it on
        send, recv = (me + 1 - step) % n, (me - step) % n
        chunks[recv] = comm.exchange.send_recv(chunks[send], right, left, group)
    return torch.cat(chunks)[:flat.numel()].reshape(x.shape)
