"""Forward and backward passes over micro-batches through the pipeline, after Megatron-core's
``pipeline_parallel/schedules.py``.

    forward_backward_func = get_forward_backward_func()          # or (schedule="gpipe")
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step, data_iterator=data_iterator, model=model,
        num_microbatches=m, seq_length=s, micro_batch_size=b, forward_only=False)

``forward_step_func(data_iterator, model) -> (output_tensor, loss_func)`` runs one micro-batch
through one model chunk; on the last stage ``loss_func(output_tensor)`` returns
``(loss, reduced_dict)``. As in Megatron, each micro-batch's loss is divided by ``m`` before its
backward (so the accumulated gradient is that of the mean loss), and the function returns the
list of ``reduced_dict`` — one per micro-batch on the last stage, ``[]`` on the others.
``model`` is one module, or a list of ``v`` model chunks for the interleaved schedule (then
``data_iterator`` is a list too, one per chunk). A stage receives its input through
``model.set_input_tensor([tensor])`` (``[None]`` on the first stage), Megatron's convention.
Optional keywords: ``tensor_shape`` overrides ``(s, b, h)``; ``dtype`` of the messages
(default ``config.pipeline_dtype`` / ``params_dtype`` / fp32); ``grad_scale_func`` scales the
last stage's loss before its backward (fp16 loss scaling, Megatron's ``config.grad_scale_func``).

The schedules (Narayanan et al. 2021, §2.2; GPipe: Huang et al. 2019), each written out as
its loops: :func:`forward_backward_pipelining_gpipe` (all forwards, then all backwards),
:func:`forward_backward_pipelining_without_interleaving` (1F1B: warm-up, steady state,
cool-down) and :func:`forward_backward_pipelining_with_interleaving` (1F1B over ``v`` model
chunks per stage). :mod:`~mpu_lab.perf.pipeline_order` plans the same op orders on paper
(and checks their messages for deadlocks); a test holds the two together. Nothing here
measures: to see when each forward and backward ran, hook the model chunks from outside, as
:mod:`mpu_lab.perf.pipeline_timeline` does.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from mpu_lab.core import parallel_state as ps
from mpu_lab.core.pipeline_parallel import p2p_communication as p2p
from mpu_lab.core.pipeline_parallel.partition import canonical_schedule, default_schedule
from mpu_lab.core.pipeline_parallel.utils import (
    chunks_and_iterators, message_shape_and_dtype, unwrap_model)


# --------------------------------------------------------------------------- one micro-batch
def forward_step(forward_step_func: Callable, data_iterator, model: torch.nn.Module,
                 num_microbatches: int, input_tensor: Optional[torch.Tensor],
                 forward_data_store: List[Any], forward_only: bool = False):
    """One micro-batch through one model chunk (Megatron's ``forward_step``). On the last stage
    the output is the micro-batch's loss divided by ``num_microbatches``."""
    target = unwrap_model(model)
    if hasattr(target, "set_input_tensor"):
        target.set_input_tensor([input_tensor])
    elif input_tensor is not None:
        raise AttributeError(
            f"{type(target).__name__} has no set_input_tensor(): a pipeline stage other than the "
            f"first receives its input through model.set_input_tensor([tensor]) (Megatron)")
    with torch.set_grad_enabled(not forward_only):
        output_tensor, loss_func = forward_step_func(data_iterator, model)
        if ps.is_pipeline_last_stage():
            loss, reduced = _split_loss(loss_func(output_tensor))
            output_tensor = loss / num_microbatches     # mean over micro-batches, as Megatron
            forward_data_store.append(reduced)
    return output_tensor


def _split_loss(result):
    """``loss_func``'s result as ``(loss, reduced_dict)``; a bare tensor is also accepted."""
    if isinstance(result, torch.Tensor):
        return result, {"loss": result.detach()}
    if isinstance(result, (tuple, list)) and len(result) == 2:
        return result[0], result[1]
    raise TypeError("loss_func must return (loss, reduced_dict) or a loss tensor, got "
                    f"{type(result).__name__}")


def backward_step(input_tensor: Optional[torch.Tensor], output_tensor: torch.Tensor,
                  output_tensor_grad: Optional[torch.Tensor],
                  grad_scale_func: Optional[Callable] = None) -> Optional[torch.Tensor]:
    """Backward of one micro-batch through one model chunk (Megatron's ``backward_step``):
    from the loss on the last stage, else from the gradient the next stage sent. Returns the
    gradient of the stage's input, for the previous stage (``None`` on the first stage)."""
    if output_tensor_grad is None:
        if grad_scale_func is not None:
            output_tensor = grad_scale_func(output_tensor)
        torch.autograd.backward(output_tensor)
    else:
        torch.autograd.backward(output_tensor,
                                grad_tensors=output_tensor_grad.to(output_tensor.dtype))
    if input_tensor is None:
        return None
    if input_tensor.grad is None:
        raise RuntimeError("a stage's input got no gradient: the output must depend on the "
                           "tensor given to set_input_tensor()")
    return input_tensor.grad


# --------------------------------------------------------------------------- the schedules
def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model, num_microbatches,
                                   seq_length=None, micro_batch_size=None, forward_only=False,
                                   tensor_shape=None, dtype=None, grad_scale_func=None):
    """One stage: forward and backward of each micro-batch in turn (gradient accumulation)."""
    (model,), (data_iterator,) = chunks_and_iterators("no-pipelining", model, data_iterator,
                                                      num_microbatches)
    forward_data_store: List[Any] = []
    for _ in range(num_microbatches):
        output_tensor = forward_step(forward_step_func, data_iterator, model, num_microbatches,
                                     None, forward_data_store, forward_only)
        if not forward_only:
            backward_step(None, output_tensor, None, grad_scale_func)
    return forward_data_store


def forward_backward_pipelining_gpipe(*, forward_step_func, data_iterator, model, num_microbatches,
                                      seq_length, micro_batch_size, forward_only=False,
                                      tensor_shape=None, dtype=None, grad_scale_func=None):
    """All forwards, then all backwards (Huang et al. 2019, GPipe): every stage holds the
    activations of all ``m`` micro-batches at the turn."""
    (model,), (data_iterator,) = chunks_and_iterators("gpipe", model, data_iterator,
                                                      num_microbatches)
    shape, dtype = message_shape_and_dtype(model, seq_length, micro_batch_size, tensor_shape, dtype)
    input_tensors, output_tensors, forward_data_store = [], [], []

    # Run all forward passes.
    for _ in range(num_microbatches):
        input_tensor = p2p.recv_forward(shape, dtype)
        output_tensor = forward_step(forward_step_func, data_iterator, model, num_microbatches,
                                     input_tensor, forward_data_store, forward_only)
        p2p.send_forward(output_tensor, shape, dtype)
        if not forward_only:
            input_tensors.append(input_tensor)
            output_tensors.append(output_tensor)

    # Run all backward passes, in the same micro-batch order.
    for _ in range(len(output_tensors)):
        output_tensor_grad = p2p.recv_backward(shape, dtype)
        input_tensor_grad = backward_step(input_tensors.pop(0), output_tensors.pop(0),
                                          output_tensor_grad, grad_scale_func)
        p2p.send_backward(input_tensor_grad, shape, dtype)
    return forward_data_store


def forward_backward_pipelining_without_interleaving(
        *, forward_step_func, data_iterator, model, num_microbatches, seq_length,
        micro_batch_size, forward_only=False, tensor_shape=None, dtype=None,
        grad_scale_func=None):
    """1F1B, PipeDream-Flush (Narayanan et al. 2021, §2.2.1): a few warm-up forwards, then one
    forward and one backward in turn, then the cool-down backwards. The bubble is GPipe's, but
    stage ``r`` holds at most ``p - r`` micro-batches' activations instead of ``m``."""
    (model,), (data_iterator,) = chunks_and_iterators("1f1b", model, data_iterator,
                                                      num_microbatches)
    shape, dtype = message_shape_and_dtype(model, seq_length, micro_batch_size, tensor_shape, dtype)

    # Compute number of warmup microbatches: stage r runs p - r - 1 forwards before its first
    # backward, just enough to fill the stages after it; the last stage runs none.
    num_warmup_microbatches = min(ps.get_pipeline_model_parallel_world_size()
                                  - ps.get_pipeline_model_parallel_rank() - 1, num_microbatches)
    num_microbatches_remaining = num_microbatches - num_warmup_microbatches
    # Input and output of every micro-batch in flight, oldest first, until its backward.
    input_tensors, output_tensors, forward_data_store = [], [], []

    def forward(input_tensor):
        return forward_step(forward_step_func, data_iterator, model, num_microbatches,
                            input_tensor, forward_data_store, forward_only)

    # Run warmup forward passes.
    for _ in range(num_warmup_microbatches):
        input_tensor = p2p.recv_forward(shape, dtype)
        output_tensor = forward(input_tensor)
        p2p.send_forward(output_tensor, shape, dtype)
        if not forward_only:
            input_tensors.append(input_tensor)
            output_tensors.append(output_tensor)

    # Before running 1F1B, need to receive first forward tensor.
    if num_microbatches_remaining > 0:
        input_tensor = p2p.recv_forward(shape, dtype)

    # Run 1F1B in steady state.
    for i in range(num_microbatches_remaining):
        last_iteration = i == num_microbatches_remaining - 1
        output_tensor = forward(input_tensor)
        if forward_only:
            p2p.send_forward(output_tensor, shape, dtype)
            if not last_iteration:
                input_tensor = p2p.recv_forward(shape, dtype)
            continue
        output_tensor_grad = p2p.send_forward_recv_backward(output_tensor, shape, dtype)
        input_tensors.append(input_tensor)
        output_tensors.append(output_tensor)
        # Backward of the oldest micro-batch in flight.
        input_tensor_grad = backward_step(input_tensors.pop(0), output_tensors.pop(0),
                                          output_tensor_grad, grad_scale_func)
        if last_iteration:
            p2p.send_backward(input_tensor_grad, shape, dtype)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_tensor_grad, shape, dtype)

    # Run cooldown backward passes.
    if not forward_only:
        for _ in range(num_warmup_microbatches):
            output_tensor_grad = p2p.recv_backward(shape, dtype)
            input_tensor_grad = backward_step(input_tensors.pop(0), output_tensors.pop(0),
                                              output_tensor_grad, grad_scale_func)
            p2p.send_backward(input_tensor_grad, shape, dtype)
    return forward_data_store


def forward_backward_pipelining_with_interleaving(
        *, forward_step_func, data_iterator, model, num_microbatches, seq_length,
        micro_batch_size, forward_only=False, tensor_shape=None, dtype=None,
        grad_scale_func=None):
    """Interleaved 1F1B (Narayanan et al. 2021, §2.2.2): each stage holds ``v`` model chunks,
    chunk ``k`` of rank ``r`` being virtual stage ``k·p + r``. Micro-batches go through the
    chunks in groups of ``p``: the bubble shrinks by ``v`` for ``v`` times the messages."""
    chunks, iterators = chunks_and_iterators("interleaved", model, data_iterator, num_microbatches)
    shape, dtype = message_shape_and_dtype(chunks[0], seq_length, micro_batch_size,
                                           tensor_shape, dtype)
    p, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    num_model_chunks = len(chunks)
    total_num_microbatches = num_microbatches * num_model_chunks
    all_warmup_microbatches = False
    if forward_only:
        num_warmup_microbatches = total_num_microbatches
    elif num_microbatches == p:
        # As many micro-batches as stages: run all forward passes, then all backward passes.
        num_warmup_microbatches = total_num_microbatches
        all_warmup_microbatches = True
    else:
        # Narayanan et al. 2021, §2.2.2: every stage first runs the (v - 1)·p chunk forwards of
        # the chunks before the last, then 2 more per stage after it, so that the last stage
        # can start 1F1B at once: (p - rank - 1)·2 + (v - 1)·p, at most m·v.
        num_warmup_microbatches = (p - rank - 1) * 2 + (num_model_chunks - 1) * p
        num_warmup_microbatches = min(num_warmup_microbatches, total_num_microbatches)
    num_microbatches_remaining = total_num_microbatches - num_warmup_microbatches

    def get_model_chunk_id(k, forward):
        """Chunk of the k-th forward (or backward) of this stage: p micro-batches go through
        chunk 0, then the same p through chunk 1, ...; backwards visit the chunks in reverse."""
        chunk = (k % (p * num_model_chunks)) // p
        return chunk if forward else num_model_chunks - chunk - 1

    # Per chunk, oldest first: inputs received (or None on the first stage) and outputs of
    # the forwards not yet run backward, and gradients received for their backwards.
    input_tensors = [[] for _ in chunks]
    output_tensors = [[] for _ in chunks]
    output_tensor_grads = [[] for _ in chunks]
    forward_data_store: List[Any] = []

    def forward_step_helper(k):
        chunk = get_model_chunk_id(k, forward=True)
        ps.set_virtual_pipeline_model_parallel_rank(chunk)
        if ps.is_pipeline_first_stage() and len(input_tensors[chunk]) == len(output_tensors[chunk]):
            input_tensors[chunk].append(None)
        output_tensor = forward_step(forward_step_func, iterators[chunk], chunks[chunk],
                                     num_microbatches, input_tensors[chunk][-1],
                                     forward_data_store, forward_only)
        output_tensors[chunk].append(output_tensor)
        if forward_only:   # nothing to keep for a backward
            input_tensors[chunk].pop()
            output_tensors[chunk].pop()
        return output_tensor

    def backward_step_helper(k):
        chunk = get_model_chunk_id(k, forward=False)
        ps.set_virtual_pipeline_model_parallel_rank(chunk)
        if ps.is_pipeline_last_stage() and not output_tensor_grads[chunk]:
            output_tensor_grads[chunk].append(None)
        return backward_step(input_tensors[chunk].pop(0), output_tensors[chunk].pop(0),
                             output_tensor_grads[chunk].pop(0), grad_scale_func)

    # Run warmup forward passes.
    ps.set_virtual_pipeline_model_parallel_rank(0)
    input_tensors[0].append(p2p.recv_forward(shape, dtype))
    for k in range(num_warmup_microbatches):
        output_tensor = forward_step_helper(k)
        # Receive the next forward's input, except where the next chunk is the first one on
        # the first stage (it reads data) and after the last forward.
        next_forward_model_chunk_id = get_model_chunk_id(k + 1, forward=True)
        recv_prev = not (ps.is_pipeline_first_stage(ignore_virtual=True)
                         and next_forward_model_chunk_id == 0)
        if k == total_num_microbatches - 1:
            recv_prev = False
        if ps.is_pipeline_last_stage():   # the loss goes nowhere
            output_tensor = None
        if k == num_warmup_microbatches - 1 and not forward_only and not all_warmup_microbatches:
            # The last warm-up forward also receives the gradient of the first backward.
            recv_next = not ps.is_pipeline_last_stage(ignore_virtual=True)
            input_tensor, output_tensor_grad = p2p.send_forward_backward_recv_forward_backward(
                output_tensor, None, recv_prev=recv_prev, recv_next=recv_next,
                tensor_shape=shape, dtype=dtype)
            output_tensor_grads[num_model_chunks - 1].append(output_tensor_grad)
        else:
            input_tensor = p2p.send_forward_recv_forward(output_tensor, recv_prev=recv_prev,
                                                         tensor_shape=shape, dtype=dtype)
        input_tensors[next_forward_model_chunk_id].append(input_tensor)

    # Run 1F1B in steady state: one forward and one backward, then all four messages at once.
    for k in range(num_microbatches_remaining):
        forward_k = k + num_warmup_microbatches
        output_tensor = forward_step_helper(forward_k)
        backward_k = k
        input_tensor_grad = backward_step_helper(backward_k)

        # Nothing to send from the last virtual stage's forward or the first one's backward.
        ps.set_virtual_pipeline_model_parallel_rank(get_model_chunk_id(forward_k, forward=True))
        if ps.is_pipeline_last_stage():
            output_tensor = None
        ps.set_virtual_pipeline_model_parallel_rank(get_model_chunk_id(backward_k, forward=False))
        if ps.is_pipeline_first_stage():
            input_tensor_grad = None

        # Which chunk the arriving activation is for: on the first stage it comes from the last
        # stage, which is p - 1 forwards behind; elsewhere it is the next forward's.
        recv_prev = True
        if ps.is_pipeline_first_stage(ignore_virtual=True):
            next_forward_model_chunk_id = get_model_chunk_id(forward_k - (p - 1), forward=True)
            if next_forward_model_chunk_id == num_model_chunks - 1:
                recv_prev = False
            next_forward_model_chunk_id += 1
        else:
            next_forward_model_chunk_id = get_model_chunk_id(forward_k + 1, forward=True)
        # Likewise the arriving gradient: on the last stage it comes from the first stage.
        recv_next = True
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            next_backward_model_chunk_id = get_model_chunk_id(backward_k - (p - 1), forward=False)
            if next_backward_model_chunk_id == 0:
                recv_next = False
            next_backward_model_chunk_id -= 1
        else:
            next_backward_model_chunk_id = get_model_chunk_id(backward_k + 1, forward=False)
        if k == num_microbatches_remaining - 1:   # the last forward's input came already
            recv_prev = False

        input_tensor, output_tensor_grad = p2p.send_forward_backward_recv_forward_backward(
            output_tensor, input_tensor_grad, recv_prev=recv_prev, recv_next=recv_next,
            tensor_shape=shape, dtype=dtype)
        if recv_prev:
            input_tensors[next_forward_model_chunk_id].append(input_tensor)
        if recv_next:
            output_tensor_grads[next_backward_model_chunk_id].append(output_tensor_grad)

    # Run cooldown backward passes (flush out pipeline).
    if not forward_only:
        if all_warmup_microbatches:
            ps.set_virtual_pipeline_model_parallel_rank(num_model_chunks - 1)
            output_tensor_grads[num_model_chunks - 1].append(p2p.recv_backward(shape, dtype))
        for k in range(num_microbatches_remaining, total_num_microbatches):
            input_tensor_grad = backward_step_helper(k)
            next_backward_model_chunk_id = get_model_chunk_id(k + 1, forward=False)
            recv_next = not (ps.is_pipeline_last_stage(ignore_virtual=True)
                             and next_backward_model_chunk_id == num_model_chunks - 1)
            if k == total_num_microbatches - 1:
                recv_next = False
            output_tensor_grads[next_backward_model_chunk_id].append(
                p2p.send_backward_recv_backward(input_tensor_grad, recv_next=recv_next,
                                                tensor_shape=shape, dtype=dtype))
    ps.set_virtual_pipeline_model_parallel_rank(0)
    return forward_data_store


# --------------------------------------------------------------------------- Megatron's entry
_BY_NAME = {
    "no-pipelining": forward_backward_no_pipelining,
    "gpipe": forward_backward_pipelining_gpipe,
    "1f1b": forward_backward_pipelining_without_interleaving,
    "interleaved": forward_backward_pipelining_with_interleaving,
}


def get_forward_backward_func(schedule: Optional[str] = None) -> Callable[..., List[Any]]:
    """The schedule function, as Megatron's ``get_forward_backward_func()``.

    Without ``schedule``: interleaved when ``virtual_pipeline_model_parallel_size`` is set,
    1F1B when the pipeline has more than one stage, no pipelining otherwise (needs
    ``initialize_model_parallel``). ``schedule`` picks one by name: ``"gpipe"`` (also
    ``"afab"``), ``"1f1b"``, ``"interleaved"``, ``"no-pipelining"``.
    """
    if schedule is None:
        schedule = default_schedule(ps.get_pipeline_model_parallel_world_size(),
                                    ps.get_virtual_pipeline_model_parallel_world_size())
    return _BY_NAME[canonical_schedule(schedule)]


def average_losses_across_microbatches(forward_data_store: List[Dict[str, Any]]) -> Dict[str, float]:
    """Mean of each key of the per-micro-batch dicts (Megatron's training loop does this on
    the last stage); ``{}`` on other stages."""
    if not forward_data_store:
        return {}
    keys = forward_data_store[0].keys()
    return {k: float(sum(float(d[k]) for d in forward_data_store) / len(forward_data_store))
            for k in keys}
