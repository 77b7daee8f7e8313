# Lab 12, section 4: one answer to my_zbh1_order. Load it on purpose, in a new cell:
#     %load solutions/12_zero_bubble.py
# run that cell, then grade it:
#     grader.grade(solution_zbh1_order, exercises.ZBH1_ORDER, world)


def solution_zbh1_order(stage, num_stages, num_microbatches):
    m = num_microbatches
    warmup = min(num_stages - stage - 1, m)    # as 1F1B: fill the stages after this one
    order = [("F", k) for k in range(warmup)]
    held = min(stage, m)                       # stage r holds back its first r weight gradients
    next_w = 0
    for k in range(m):
        if k + warmup < m:                     # steady state: one forward, then one backward
            order.append(("F", k + warmup))
        order.append(("B", k))
        if k >= held:                          # the others right after a B, as 1F1B would
            order.append(("W", next_w))
            next_w += 1
    # the held-back weight gradients fill the slots where 1F1B's cool-down waits
    return order + [("W", k) for k in range(next_w, m)]
