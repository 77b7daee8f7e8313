# Lab 11, section 5: one answer to my_1f1b_order. Load it on purpose, in a new cell:
#     %load solutions/11_pipeline_parallel.py
# run that cell, then grade it:
#     grader.grade(solution_1f1b_order, exercises.ONE_F_ONE_B, world)


def solution_1f1b_order(stage, num_stages, num_microbatches):
    warmup = min(num_stages - stage - 1, num_microbatches)    # no more than there are
    order = [("F", k) for k in range(warmup)]
    for k in range(num_microbatches - warmup):                 # steady state: 1F, then 1B
        order += [("F", warmup + k), ("B", k)]
    return order + [("B", k) for k in range(num_microbatches - warmup, num_microbatches)]


# Lab 11, section 5, "Build: the 1F1B loop": one answer to my_1f1b_loop. After %load,
# grade it with
#     grader.grade(solution_1f1b_loop, exercises.ONE_F_ONE_B_LOOP, world)
def solution_1f1b_loop(stage, num_stages, num_microbatches, forward, backward, p2p):
    warmup = min(num_stages - stage - 1, num_microbatches)
    remaining = num_microbatches - warmup
    inputs, outputs = [], []                  # the micro-batches in flight, oldest first

    for _ in range(warmup):                   # fill the stages after this one
        input_tensor = p2p.recv_forward()
        output_tensor = forward(input_tensor)
        p2p.send_forward(output_tensor)
        inputs.append(input_tensor)
        outputs.append(output_tensor)

    if remaining > 0:
        input_tensor = p2p.recv_forward()
    for i in range(remaining):                # steady state: one forward, one backward
        output_tensor = forward(input_tensor)
        output_grad = p2p.send_forward_recv_backward(output_tensor)
        inputs.append(input_tensor)
        outputs.append(output_tensor)
        input_grad = backward(inputs.pop(0), outputs.pop(0), output_grad)
        if i == remaining - 1:
            p2p.send_backward(input_grad)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_grad)

    for _ in range(warmup):                   # drain: the backwards still owed
        output_grad = p2p.recv_backward()
        input_grad = backward(inputs.pop(0), outputs.pop(0), output_grad)
        p2p.send_backward(input_grad)
