"""The learner's 1F1B pipeline schedule with its sends and receives (PipeDream-Flush:
Narayanan et al. 2021, §2.2.1; Megatron-core's ``pipeline_parallel/schedules.py``,
``forward_backward_pipelining_without_interleaving``): stage ``r`` of ``p`` runs ``p - r - 1``
warm-up forwards, then one forward and one backward in turn, then the cool-down backwards.
Activations go to the next stage and their gradients come back over point-to-point messages of
shape ``[s, b, h]`` (``[s/t, b, h]`` with sequence parallelism)."""
import torch
import torch.distributed as dist

from mpu_lab.core.parallel_state import (get_pipeline_model_parallel_next_rank,
                                         get_pipeline_model_parallel_prev_rank,
                                         get_pipeline_model_parallel_rank,
                                         get_pipeline_model_parallel_world_size,
                                         get_tensor_model_parallel_world_size,
                                         is_pipeline_first_stage, is_pipeline_last_stage)
from mpu_lab.core.utils import get_device


def _exchange(send_to=None, tensor=None, recv_from=None, shape=None):
    """Post a send and/or a receive, wait for both; the received tensor (or None)."""
    ops, received = [], None
    if send_to is not None:
        ops.append(dist.isend(tensor.detach().contiguous(), send_to))
    if recv_from is not None:
        received = torch.empty(shape, device=get_device(), requires_grad=True)
        ops.append(dist.irecv(received.data, recv_from))
    for op in ops:
        op.wait()
    return received


def forward_backward_pipelining_without_interleaving(
        *, forward_step_func, data_iterator, model, num_microbatches, seq_length,
        micro_batch_size, forward_only=False, **unused):
    if model.config.sequence_parallel:        # each tensor-parallel rank sends its s/t tokens
        seq_length //= get_tensor_model_parallel_world_size()
    shape = (seq_length, micro_batch_size, model.config.hidden_size)
    first, last = is_pipeline_first_stage(), is_pipeline_last_stage()
    prev = None if first else get_pipeline_model_parallel_prev_rank()
    nxt = None if last else get_pipeline_model_parallel_next_rank()
    losses, inputs, outputs = [], [], []

    def forward(input_tensor):
        model.set_input_tensor([input_tensor])
        output, loss_func = forward_step_func(data_iterator, model)
        if last:
            loss, reduced = loss_func(output)
            losses.append(reduced)
            output = loss / num_microbatches
        return output

    def backward(input_tensor, output, output_grad):
        torch.autograd.backward(output, grad_tensors=None if last else output_grad)
        return None if first else input_tensor.grad

    warmup = min(get_pipeline_model_parallel_world_size() - get_pipeline_model_parallel_rank()
                 - 1, num_microbatches)
    # Run warmup forward passes.
    for _ in range(warmup):
        x = _exchange(recv_from=prev, shape=shape)
        y = forward(x)
        _exchange(send_to=nxt, tensor=y)
        inputs.append(x)
        outputs.append(y)
    # Run 1F1B in steady state.
    x = _exchange(recv_from=prev, shape=shape) if num_microbatches > warmup else None
    for i in range(num_microbatches - warmup):
        y = forward(x)
        dy = _exchange(send_to=nxt, tensor=y, recv_from=nxt, shape=shape)
        inputs.append(x)
        outputs.append(y)
        dx = backward(inputs.pop(0), outputs.pop(0), dy)
        if i == num_microbatches - warmup - 1:
            _exchange(send_to=prev, tensor=dx)
        else:
            x = _exchange(send_to=prev, tensor=dx, recv_from=prev, shape=shape)
    # Run cooldown backward passes.
    for _ in range(warmup):
        dy = _exchange(recv_from=nxt, shape=shape)
        dx = backward(inputs.pop(0), outputs.pop(0), dy)
        _exchange(send_to=prev, tensor=dx)
    return losses
