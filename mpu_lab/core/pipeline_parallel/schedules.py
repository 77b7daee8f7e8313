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
last stage's loss before its backward (fp16 loss scaling, Megatron's ``config.grad_scale_func``);
``action_callback(kind, microbatch, chunk)`` is called as each forward (``"F"``) and backward
(``"BW"``: input and weight gradients together) starts — the hook point where an observer
records what a schedule ran, without rebinding anything.

The schedules (Narayanan et al. 2021, §2.2; GPipe: Huang et al. 2019), each written out as
its loops: :func:`forward_backward_pipelining_gpipe` (all forwards, then all backwards),
:func:`forward_backward_pipelining_without_interleaving` (1F1B: warm-up, steady state,
cool-down) and :func:`forward_backward_pipelining_with_interleaving` (1F1B over ``v`` model
chunks per stage). :mod:`~mpu_lab.perf.pipeline_order` plans the same op orders on paper
(and checks their messages for deadlocks); a test holds the two together. Nothing here
measures: to see when each forward and backward ran, hook the model chunks from outside, as
:mod:`mpu_lab.perf.pipeline_timeline` does, or pass ``action_callback``.

The zero-bubble schedules (``ZBH1``, ``ZBVZeroBubble``; Qi et al. 2024) and ``DualPipeV``, which
split backwards into ``B`` and ``W``, are action lists run by
:mod:`~mpu_lab.core.pipeline_parallel.schedule_runtime`; :func:`get_forward_backward_func`
hands them out by name too.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional

from mpu_lab.core import parallel_state as ps
from mpu_lab.core.pipeline_parallel import p2p_communication as p2p
from mpu_lab.core.pipeline_parallel import schedule_runtime
from mpu_lab.core.pipeline_parallel.microbatch_steps import backward_step, forward_step
from mpu_lab.core.pipeline_parallel.partition import canonical_schedule, default_schedule
from mpu_lab.core.pipeline_parallel.utils import chunks_and_iterators, message_shape_and_dtype


# --------------------------------------------------------------------------- the schedules
def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model, num_microbatches,
                                   seq_length=None, micro_batch_size=None, forward_only=False,
                                   tensor_shape=None, dtype=None, grad_scale_func=None,
                                   action_callback=None):
    """One stage: forward and backward of each micro-batch in turn (gradient accumulation)."""
    (model,), (data_iterator,) = chunks_and_iterators("no-pipelining", model, data_iterator,
                                                      num_microbatches)
    forward_data_store: List[Any] = []
    for i in range(num_microbatches):
        _report(action_callback, "F", i)
        output_tensor = forward_step(forward_step_func, data_iterator, model, num_microbatches,
                                     None, forward_data_store, forward_only)
        if not forward_only:
            _report(action_callback, "BW", i)
            backward_step(None, output_tensor, None, grad_scale_func)
    return forward_data_store


def _report(action_callback: Optional[Callable], kind: str, microbatch: int, chunk: int = 0):
    """Tell the observer, if any, which action starts."""
    if action_callback is not None:
        action_callback(kind, microbatch, chunk)


def forward_backward_pipelining_gpipe(*, forward_step_func, data_iterator, model, num_microbatches,
                                      seq_length, micro_batch_size, forward_only=False,
                                      tensor_shape=None, dtype=None, grad_scale_func=None,
                                      action_callback=None):
    """All forwards, then all backwards (Huang et al. 2019, GPipe): every stage holds the
    activations of all ``m`` micro-batches at the turn."""
    (model,), (data_iterator,) = chunks_and_iterators("gpipe", model, data_iterator,
                                                      num_microbatches)
    shape, dtype = message_shape_and_dtype(model, seq_length, micro_batch_size, tensor_shape, dtype)
    input_tensors, output_tensors, forward_data_store = [], [], []

    # Run all forward passes.
    for i in range(num_microbatches):
        input_tensor = p2p.recv_forward(shape, dtype)
        _report(action_callback, "F", i)
        output_tensor = forward_step(forward_step_func, data_iterator, model, num_microbatches,
                                     input_tensor, forward_data_store, forward_only)
        p2p.send_forward(output_tensor, shape, dtype)
        if not forward_only:
            input_tensors.append(input_tensor)
            output_tensors.append(output_tensor)

    # Run all backward passes, in the same micro-batch order.
    for i in range(len(output_tensors)):
        output_tensor_grad = p2p.recv_backward(shape, dtype)
        _report(action_callback, "BW", i)
        input_tensor_grad = backward_step(input_tensors.pop(0), output_tensors.pop(0),
                                          output_tensor_grad, grad_scale_func)
        p2p.send_backward(input_tensor_grad, shape, dtype)
    return forward_data_store


def forward_backward_pipelining_without_interleaving(
        *, forward_step_func, data_iterator, model, num_microbatches, seq_length,
        micro_batch_size, forward_only=False, tensor_shape=None, dtype=None,
        grad_scale_func=None, action_callback=None):
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
    done = {"F": 0, "BW": 0}      # forwards and backwards run so far: the next micro-batch ids

    def forward(input_tensor):
        _report(action_callback, "F", done["F"])
        done["F"] += 1
        return forward_step(forward_step_func, data_iterator, model, num_microbatches,
                            input_tensor, forward_data_store, forward_only)

    def backward(output_tensor_grad):
        """Backward of the oldest micro-batch in flight."""
        _report(action_callback, "BW", done["BW"])
        done["BW"] += 1
        return backward_step(input_tensors.pop(0), output_tensors.pop(0), output_tensor_grad,
                             grad_scale_func)

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
        input_tensor_grad = backward(output_tensor_grad)
        if last_iteration:
            p2p.send_backward(input_tensor_grad, shape, dtype)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_tensor_grad, shape, dtype)

    # Run cooldown backward passes.
    if not forward_only:
        for _ in range(num_warmup_microbatches):
            output_tensor_grad = p2p.recv_backward(shape, dtype)
            input_tensor_grad = backward(output_tensor_grad)
            p2p.send_backward(input_tensor_grad, shape, dtype)
    return forward_data_store


def forward_backward_pipelining_with_interleaving(
        *, forward_step_func, data_iterator, model, num_microbatches, seq_length,
        micro_batch_size, forward_only=False, tensor_shape=None, dtype=None,
        grad_scale_func=None, action_callback=None):
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

    def get_microbatch_id_in_model_chunk(k):
        """Micro-batch of the k-th forward (or backward) of this stage (Megatron's name)."""
        return (k // (p * num_model_chunks)) * p + k % p

    # Per chunk, oldest first: inputs received (or None on the first stage) and outputs of
    # the forwards not yet run backward, and gradients received for their backwards.
    input_tensors = [[] for _ in chunks]
    output_tensors = [[] for _ in chunks]
    output_tensor_grads = [[] for _ in chunks]
    forward_data_store: List[Any] = []

    def forward_step_helper(k):
        chunk = get_model_chunk_id(k, forward=True)
        ps.set_virtual_pipeline_model_parallel_rank(chunk)
        _report(action_callback, "F", get_microbatch_id_in_model_chunk(k), chunk)
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
        _report(action_callback, "BW", get_microbatch_id_in_model_chunk(k), chunk)
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
# The action-list schedules (schedule_runtime), by canonical name -> torch's name.
_ACTION_LIST_NAMES = {"zbh1": "ZBH1", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}


def get_forward_backward_func(schedule: Optional[str] = None) -> Callable[..., List[Any]]:
    """The schedule function, as Megatron's ``get_forward_backward_func()``.

    Without ``schedule``: interleaved when ``virtual_pipeline_model_parallel_size`` is set,
    1F1B when the pipeline has more than one stage, no pipelining otherwise (needs
    ``initialize_model_parallel``). ``schedule`` picks one by name, in any case, torch's
    names or Megatron's: ``"GPipe"`` (also ``"afab"``), ``"1F1B"``, ``"Interleaved1F1B"``
    (``"interleaved"``), ``"no-pipelining"``, and the zero-bubble ``"ZBH1"``,
    ``"ZBVZeroBubble"`` and ``"DualPipeV"`` (action lists; their function takes the same
    keywords).
    """
    if schedule is None:
        schedule = default_schedule(ps.get_pipeline_model_parallel_world_size(),
                                    ps.get_virtual_pipeline_model_parallel_world_size())
    name = canonical_schedule(schedule)
    if name in _ACTION_LIST_NAMES:
        return functools.partial(schedule_runtime.forward_backward_pipelining_with_action_list,
                                 _ACTION_LIST_NAMES[name])
    if name not in _BY_NAME:
        raise ValueError(f"pipeline schedule {schedule!r} has no runtime yet; choose one of "
                         f"{sorted(_BY_NAME) + sorted(_ACTION_LIST_NAMES.values())}")
    return _BY_NAME[name]


def average_losses_across_microbatches(forward_data_store: List[Dict[str, Any]]) -> Dict[str, float]:
    """Mean of each key of the per-micro-batch dicts (Megatron's training loop does this on
    the last stage); ``{}`` on other stages."""
    if not forward_data_store:
        return {}
    keys = forward_data_store[0].keys()
    return {k: float(sum(float(d[k]) for d in forward_data_store) / len(forward_data_store))
            for k in keys}
