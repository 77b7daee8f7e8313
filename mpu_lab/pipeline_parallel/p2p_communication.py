"""Point-to-point messages between neighbouring pipeline stages, after Megatron-core's
``pipeline_parallel/p2p_communication.py``.

Stage ``r`` sends its output activation ``[s, b, h]`` to the next stage and, in the backward
pass, the gradient of its input to the previous one (Narayanan et al. 2021, §2.2). The shape is
known in advance (``seq_length x micro_batch_size x hidden_size``), so the receiver allocates
the buffer itself and no shape has to travel first.

How it avoids deadlocks: every call posts all of its sends and receives at once with
``torch.distributed.batch_isend_irecv`` and then waits for all of them. Two neighbours that
each send to and receive from the other in the same call (``send_forward_recv_backward`` on
one, ``send_backward_recv_forward`` on the other) therefore never wait on each other. The
schedules call :func:`communicate` between steps with the messages
:func:`~mpu_lab.pipeline_parallel.order.communication_plan` lists; ``verify_communication``
in that module checks the plan under NCCL's matching rules.

Backends: NCCL sends GPU tensors directly. gloo sends CPU tensors; when a rank's tensors are on
a GPU that it shares with other ranks (then the backend is gloo: NCCL refuses two ranks on
one GPU, see :func:`mpu_lab.distributed.choose_backend`) the message is staged through host
memory here. Activations travel with tag 0 and gradients with tag 1 (gloo matches on tags;
NCCL matches in posting order, which the plan keeps consistent).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from mpu_lab import comm, distributed
from mpu_lab import parallel_state as ps

ACTIVATION_TAG = 0   # travelling to the next stage
GRADIENT_TAG = 1     # travelling to the previous stage


def _stage_through_host(group) -> bool:
    return distributed.get_device().type == "cuda" and dist.get_backend(group) == "gloo"


def _outgoing(tensor: torch.Tensor, shape: Sequence[int], dtype, host: bool) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(shape):
        # A wrong shape would not fail on the sender: the receiver would hang or read garbage.
        raise ValueError(f"pipeline p2p: tensor of shape {tuple(tensor.shape)} sent where the "
                         f"peer expects {tuple(shape)} (seq_length, micro_batch_size, hidden_size)")
    out = tensor.detach().to(dtype).contiguous()
    return out.cpu() if host else out


def communicate(*, tensor_send_next: Optional[torch.Tensor] = None,
                tensor_send_prev: Optional[torch.Tensor] = None,
                recv_prev: bool = False, recv_next: bool = False,
                tensor_shape: Sequence[int], dtype: torch.dtype = torch.float32
                ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Send to / receive from the neighbouring pipeline ranks in one batch; return
    ``(tensor_recv_prev, tensor_recv_next)`` (Megatron's ``_communicate``).

    ``tensor_send_next``: activation for the next rank; ``tensor_send_prev``: gradient for the
    previous rank; ``recv_prev``: receive an activation from the previous rank (it comes back
    with ``requires_grad=True``, ready to be this stage's input); ``recv_next``: receive a
    gradient from the next rank. Every tensor has ``tensor_shape``; sent tensors are cast to
    ``dtype``. A no-op returning ``(None, None)`` when nothing is asked.
    """
    group = ps.get_pipeline_model_parallel_group()
    next_rank = ps.get_pipeline_model_parallel_next_rank()
    prev_rank = ps.get_pipeline_model_parallel_prev_rank()
    device = distributed.get_device()
    host = _stage_through_host(group)
    buffer_device = torch.device("cpu") if host else device
    shape = tuple(int(d) for d in tensor_shape)

    ops: List[dist.P2POp] = []
    recv_prev_buf = recv_next_buf = None
    # Activations first, then gradients: with two stages next == prev, and both ranks must
    # post the messages between them in the same order (see order.Boundary).
    if tensor_send_next is not None:
        out = _outgoing(tensor_send_next, shape, dtype, host)
        comm._record("send", group, out)
        ops.append(dist.P2POp(dist.isend, out, next_rank, group, ACTIVATION_TAG))
    if recv_prev:
        recv_prev_buf = torch.empty(shape, dtype=dtype, device=buffer_device)
        comm._record("recv", group, recv_prev_buf)
        ops.append(dist.P2POp(dist.irecv, recv_prev_buf, prev_rank, group, ACTIVATION_TAG))
    if tensor_send_prev is not None:
        out = _outgoing(tensor_send_prev, shape, dtype, host)
        comm._record("send", group, out)
        ops.append(dist.P2POp(dist.isend, out, prev_rank, group, GRADIENT_TAG))
    if recv_next:
        recv_next_buf = torch.empty(shape, dtype=dtype, device=buffer_device)
        comm._record("recv", group, recv_next_buf)
        ops.append(dist.P2POp(dist.irecv, recv_next_buf, next_rank, group, GRADIENT_TAG))
    if not ops:
        return None, None

    def post_and_wait():
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if device.type == "cuda" and not host:
            # Megatron does the same: the received buffers must be complete before the next
            # kernel reads them on another stream.
            torch.cuda.synchronize()

    # Timed as one "p2p" call when a comm.CommTimer is active: the time includes waiting for
    # the peer to reach the matching call (the pipeline bubble), not only the transfer.
    comm._timed("p2p", group, ops[0].tensor, post_and_wait)
    if host:
        recv_prev_buf = recv_prev_buf.to(device) if recv_prev_buf is not None else None
        recv_next_buf = recv_next_buf.to(device) if recv_next_buf is not None else None
    if recv_prev_buf is not None:
        recv_prev_buf.requires_grad_(True)
    return recv_prev_buf, recv_next_buf


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
    """Interleaved steady state: all four messages of a forward+backward step in one batch;
    returns ``(input_tensor, output_tensor_grad)``."""
    return communicate(tensor_send_next=output_tensor, tensor_send_prev=input_tensor_grad,
                       recv_prev=recv_prev, recv_next=recv_next,
                       tensor_shape=tensor_shape, dtype=dtype)
