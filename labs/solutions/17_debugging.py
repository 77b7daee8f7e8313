# Lab 17, "Fix it: write the exchange": one answer to my_exchange. Load it on purpose, in a new
# cell:
#     %load solutions/17_debugging.py
# run that cell, then grade it:
#     grader.grade(solution_exchange, exercises.EXCHANGE, world)
# It runs on the ranks, where torch and dist exist.


def solution_exchange(stage, num_stages, mine):
    got = {}
    for peer in [p for p in (stage - 1, stage + 1) if 0 <= p < num_stages]:
        got[peer] = torch.empty_like(mine)
        if stage % 2 == 0:                        # even: send, then receive
            dist.send(mine, peer)
            dist.recv(got[peer], peer)
        else:                                     # odd: receive, then send
            dist.recv(got[peer], peer)
            dist.send(mine, peer)
    return got.get(stage - 1), got.get(stage + 1)
