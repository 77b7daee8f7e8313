# Lab 09, section 4: one answer to my_1f1b_order. Load it on purpose, in a new cell:
#     %load solutions/09_pipeline_parallel.py
# run that cell, then grade it:
#     exercises.grade(solution_1f1b_order, exercises.pipeline_parallel.ONE_F_ONE_B, world)


def solution_1f1b_order(stage, num_stages, num_microbatches):
    warmup = min(num_stages - stage - 1, num_microbatches)    # no more than there are
    order = [("F", k) for k in range(warmup)]
    for k in range(num_microbatches - warmup):                 # steady state: 1F, then 1B
        order += [("F", warmup + k), ("B", k)]
    return order + [("B", k) for k in range(num_microbatches - warmup, num_microbatches)]
