"""Point-to-point messages between neighbouring pipeline stages, after Megatron-core's
``pipeline_parallel/p2p_communication.py``.

Stage ``r`` sends its output activation ``[s, b, h]`` to the next stage and, in the backward
pass, the gradient of its input to the previous one (Narayanan et al. 2021, §2.2). The shape is
known in advance (``seq_length x micro_batch_size x hidden_size``), so the receiver allocates
the buffer itself and no shape has to travel first.

Every call posts its sends and receives as plain ``isend`` / ``irecv`` in Megatron's fixed
order (``_p2p_ops``: even ranks send first, odd ranks receive first), then waits for all of
them (:func:`mpu_lab.core.comm.exchange.isend_irecv`). Two neighbours that send to and receive
from each other in the same call (``send_forward_recv_backward`` on one,
``send_backward_recv_forward`` on the other) therefore never wait on each other, even where a
send completes only once the peer has posted its receive (NCCL). ``batch_isend_irecv`` is not
used: on gloo it is not reliable.

Backends: NCCL sends GPU tensors directly. gloo sends CPU tensors; when a rank's tensors are on
a GPU that it shares with other ranks (then the backend is gloo: NCCL refuses two ranks on
one GPU, see :func:`mpu_lab.training.initialize.choose_backend`) the message is staged through host
memory, as the collectives are (:mod:`mpu_lab.core.comm.staging`). Activations travel with
tag 0 and gradients with tag 1: with two stages the next and the previous rank are the same
rank, and gloo tells the two directions apart by the tag (NCCL ignores tags and matches in
posting order, which ``_p2p_ops`` keeps the same on both).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from mpu_lab.core import parallel_state as ps
from mpu_lab.core.comm import exchange, staging
from mpu_lab.core.utils import get_device

ACTIVATION_TAG = 0   # travelling to the next stage
GRADIENT_TAG = 1     # travelling to the previous stage


def _outgoing(tensor: torch.Tensor, shape: Sequence[int], dtype, group) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(shape):
        # A wrong shape would not fail on the sender: the receiver would hang or read garbage.
        raise ValueError(f"pipeline p2p: tensor of shape {tuple(tensor.shape)} sent where the "
                         f"peer expects {tuple(shape)} (seq_length, micro_batch_size, hidden_size)")
    return staging.to_backend(tensor.detach().to(dtype).contiguous(), group)[0]


def _p2p_ops(*, tensor_send_prev: Optional[torch.Tensor], tensor_recv_prev: Optional[torch.Tensor],
             tensor_send_next: Optional[torch.Tensor], tensor_recv_next: Optional[torch.Tensor],
             group, prev_rank: int, next_rank: int) -> List[dist.P2POp]:
    """The four possible messages in Megatron's order, as torch's ``P2POp`` (Megatron's
    ``_p2p_ops`` posts them in this order; :func:`~mpu_lab.core.comm.exchange.isend_irecv` does
    here).

    Even pipeline ranks send to the next stage before they receive from the previous one; odd
    ranks do the opposite. So between two neighbours one side's send always meets the other
    side's receive first, and neither blocks the other."""
    posts = [(dist.isend, tensor_send_next, next_rank, ACTIVATION_TAG),
             (dist.irecv, tensor_recv_prev, prev_rank, ACTIVATION_TAG),
             (dist.isend, tensor_send_prev, prev_rank, GRADIENT_TAG),
             (dist.irecv, tensor_recv_next, next_rank, GRADIENT_TAG)]
    if ps.get_pipeline_model_parallel_rank() % 2 == 1:
        posts = [posts[1], posts[0], posts[3], posts[2]]
    return [dist.P2POp(op, tensor, peer, group, tag) for op, tensor, peer, tag in posts
            if tensor is not None]


def communicate(*, tensor_send_next: Optional[torch.Tensor] = None,
                tensor_send_prev: Optional[torch.Tensor] = None,
                recv_prev: bool = False, recv_next: bool = False,
                tensor_shape: Sequence[int], dtype: torch.dtype = torch.float32
                ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Send to / receive from the neighbouring pipeline ranks; return
    ``(tensor_recv_prev, tensor_recv_next)`` (Megatron's ``_communicate``).

    ``tensor_send_next``: activation for the next rank; ``tensor_send_prev``: gradient for the
    previous rank; ``recv_prev``: receive an activation from the previous rank (it comes back
    with ``requires_grad=True``, ready to be this stage's input); ``recv_next``: receive a
    gradient from the next rank. Every tensor has ``tensor_shape``; sent tensors are cast to
    ``dtype``. A no-op returning ``(None, None)`` when nothing is asked.
    """
    group = ps.get_pipeline_model_parallel_group()
    device = get_device()
    buffer_device = staging.backend_device(device, group)     # the CPU where gloo carries a GPU's
    shape = tuple(int(d) for d in tensor_shape)

    send_next = _outgoing(tensor_send_next, shape, dtype, group) if tensor_send_next is not None else None
    send_prev = _outgoing(tensor_send_prev, shape, dtype, group) if tensor_send_prev is not None else None
    tensor_recv_prev = torch.empty(shape, dtype=dtype, device=buffer_device) if recv_prev else None
    tensor_recv_next = torch.empty(shape, dtype=dtype, device=buffer_device) if recv_next else None
    ops = _p2p_ops(tensor_send_prev=send_prev, tensor_recv_prev=tensor_recv_prev,
                   tensor_send_next=send_next, tensor_recv_next=tensor_recv_next,
                   group=group, prev_rank=ps.get_pipeline_model_parallel_prev_rank(),
                   next_rank=ps.get_pipeline_model_parallel_next_rank())
    if ops:
        exchange.isend_irecv(ops, group)       # posted in _p2p_ops' order, all waited for
    if tensor_recv_prev is not None:
        tensor_recv_prev = staging.from_backend(tensor_recv_prev, device).requires_grad_(True)
    if tensor_recv_next is not None:
        tensor_recv_next = staging.from_backend(tensor_recv_next, device)
    return tensor_recv_prev, tensor_recv_next


# --------------------------------------------------------------------------- Megatron's names
# Each one is a no-op at the end of the pipeline where there is no neighbour to talk to; with
# virtual stages "first"/"last" refer to the current model chunk (set_virtual_pipeline_...).
def recv_forward(tensor_shape, dtype=torch.float32) -> Optional[torch.Tensor]:
    """This stage's input activation from the previous stage (None on the first stage)."""
    if ps.is_pipeline_first_stage():
        return None
    return communicate(recv_prev=True, tensor_shape=tensor_shape, dtype=dtype)[0]


def recv_backward(tensor_shape, dtype=torch.float32) -> Optional[torch.Tensor]:
    """The gradient of this stage's output from the next stage (None on the last stage)."""
    if ps.is_pipeline_last_stage():
        return None
    return communicate(recv_next=True, tensor_shape=tensor_shape, dtype=dtype)[1]


def send_forward(output_tensor, tensor_shape, dtype=torch.float32) -> None:
    """Send this stage's output activation to the next stage (not from the last stage)."""
    if not ps.is_pipeline_last_stage():
        communicate(tensor_send_next=output_tensor, tensor_shape=tensor_shape, dtype=dtype)


def send_backward(input_tensor_grad, tensor_shape, dtype=torch.float32) -> None:
    """Send the gradient of this stage's input to the previous stage (not from the first)."""
    if not ps.is_pipeline_first_stage():
        communicate(tensor_send_prev=input_tensor_grad, tensor_shape=tensor_shape, dtype=dtype)


def send_forward_recv_backward(output_tensor, tensor_shape, dtype=torch.float32):
    """1F1B steady state after a forward: send the activation, receive the output gradient."""
    if ps.is_pipeline_last_stage():
        return None
    return communicate(tensor_send_next=output_tensor, recv_next=True,
                       tensor_shape=tensor_shape, dtype=dtype)[1]


def send_backward_recv_forward(input_tensor_grad, tensor_shape, dtype=torch.float32):
    """1F1B steady state after a backward: send the input gradient, receive the next input."""
    if ps.is_pipeline_first_stage():
        return None
    return communicate(tensor_send_prev=input_tensor_grad, recv_prev=True,
                       tensor_shape=tensor_shape, dtype=dtype)[0]


def send_forward_recv_forward(output_tensor, recv_prev: bool, tensor_shape, dtype=torch.float32):
    """Interleaved warm-up: pass an activation on and receive the next one."""
    return communicate(tensor_send_next=output_tensor, recv_prev=recv_prev,
                       tensor_shape=tensor_shape, dtype=dtype)[0]


def send_backward_recv_backward(input_tensor_grad, recv_next: bool, tensor_shape,
                                dtype=torch.float32):
    """Interleaved cool-down: pass a gradient back and receive the next one."""
    return communicate(tensor_send_prev=input_tensor_grad, recv_next=recv_next,
                       tensor_shape=tensor_shape, dtype=dtype)[1]


def send_forward_backward_recv_forward_backward(output_tensor, input_tensor_grad, recv_prev: bool,
                                                recv_next: bool, tensor_shape, dtype=torch.float32):
    """Interleaved steady state: all four messages of a forward+backward step at once;
    returns ``(input_tensor, output_tensor_grad)``."""
    return communicate(tensor_send_next=output_tensor, tensor_send_prev=input_tensor_grad,
                       recv_prev=recv_prev, recv_next=recv_next,
                       tensor_shape=tensor_shape, dtype=dtype)
