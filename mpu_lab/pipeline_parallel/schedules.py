"""Forward and backward passes over micro-batches through the pipeline, with Megatron's API.

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

The schedules (Narayanan et al. 2021, §2.2; GPipe: Huang et al. 2019) are all one loop:
:func:`~mpu_lab.pipeline_parallel.order.schedule_steps` says which forwards and backwards this
rank runs and in which order, :func:`~mpu_lab.pipeline_parallel.order.communication_plan` what
it sends and receives between them, and :func:`run_schedule` does both. So the logical
timeline (:mod:`~mpu_lab.pipeline_parallel.timeline`) and a real run follow the same list.

Every run leaves :class:`ScheduleStats` behind (:func:`get_last_schedule_stats`): a timeline of
``(kind, microbatch, chunk, start, end)`` wall-clock records and the peak number of micro-batch
activations held at once — the memory cost that 1F1B bounds by ``p`` and GPipe does not.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from mpu_lab import comm, distributed
from mpu_lab import parallel_state as ps
from mpu_lab.pipeline_parallel import p2p_communication as p2p
from mpu_lab.pipeline_parallel.order import (
    communication_plan,
    schedule_steps,
    virtual_stage,
)
from mpu_lab.pipeline_parallel.partition import canonical_schedule, check_schedule, default_schedule


@dataclasses.dataclass
class ScheduleStats:
    """What the last schedule run on this rank did."""
    schedule: str
    pipeline_parallel_rank: int
    pipeline_parallel_size: int
    num_microbatches: int
    num_model_chunks: int
    forward_only: bool
    records: List[tuple]             # (kind, microbatch, chunk, start_s, end_s), time.time()
    peak_in_flight: int              # most (micro-batch, chunk) activations held at once
    messages_sent: int
    messages_received: int

    def as_dict(self) -> Dict[str, Any]:
        """JSON-able (for ``mpu_lab.launcher.report``)."""
        out = dataclasses.asdict(self)
        out["records"] = [list(r) for r in self.records]
        return out


_LAST_STATS: List[Optional[ScheduleStats]] = [None]


def get_last_schedule_stats() -> Optional[ScheduleStats]:
    """Timeline and peak in-flight activations of the last schedule run on this rank."""
    return _LAST_STATS[0]


# --------------------------------------------------------------------------- model helpers
def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP-style wrappers (``.module``), where ``set_input_tensor`` lives."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def model_chunks_of(model) -> List[torch.nn.Module]:
    """``[model]``, or the chunks of a list / ``ModuleList`` of pipeline model chunks (the
    one place that says what a "model" argument may be: a module or this rank's chunks)."""
    if isinstance(model, (list, tuple, torch.nn.ModuleList)):
        return list(model)
    return [model]


def get_tensor_shape(model_chunk: torch.nn.Module, seq_length: int, micro_batch_size: int):
    """``(s, b, h)`` of the activations between stages, from ``model.config.hidden_size``
    (``s/t`` with sequence parallelism: each tensor-parallel rank holds its block of tokens)."""
    config = getattr(unwrap_model(model_chunk), "config", None)
    hidden = getattr(config, "hidden_size", None)
    if hidden is None:
        raise ValueError("cannot tell the hidden size of the messages between stages: give the "
                         "model chunk a .config with hidden_size, or pass tensor_shape=(s, b, h)")
    s = seq_length
    if getattr(config, "sequence_parallel", False):
        s //= ps.get_tensor_model_parallel_world_size()
    return (s, micro_batch_size, hidden)


def _pipeline_dtype(model_chunk: torch.nn.Module) -> torch.dtype:
    config = getattr(unwrap_model(model_chunk), "config", None)
    return getattr(config, "pipeline_dtype", None) or getattr(config, "params_dtype", None) \
        or torch.float32


def _set_input_tensor(model_chunk, input_tensor):
    target = unwrap_model(model_chunk)
    if hasattr(target, "set_input_tensor"):
        target.set_input_tensor([input_tensor])
    elif input_tensor is not None:
        raise AttributeError(
            f"{type(target).__name__} has no set_input_tensor(): a pipeline stage other than the "
            f"first receives its input through model.set_input_tensor([tensor]) (Megatron)")


def _split_loss(result):
    """``loss_func``'s result as ``(loss, reduced_dict)``; a bare tensor is also accepted."""
    if isinstance(result, torch.Tensor):
        return result, {"loss": result.detach()}
    if isinstance(result, (tuple, list)) and len(result) == 2:
        return result[0], result[1]
    raise TypeError("loss_func must return (loss, reduced_dict) or a loss tensor, got "
                    f"{type(result).__name__}")


# --------------------------------------------------------------------------- the one loop
def run_schedule(schedule: str, *, forward_step_func: Callable, data_iterator, model,
                 num_microbatches: int, seq_length: int, micro_batch_size: int,
                 forward_only: bool = False, tensor_shape: Optional[Sequence[int]] = None,
                 dtype: Optional[torch.dtype] = None, grad_scale_func: Optional[Callable] = None,
                 record_timeline: bool = True) -> List[Any]:
    """Run ``schedule`` on this rank. The public entry points are the ``forward_backward_*``
    functions below (Megatron's names), which call this.

    Extra keywords (all optional): ``tensor_shape`` overrides ``(s, b, h)``; ``dtype`` of the
    messages (default ``config.pipeline_dtype`` / ``params_dtype`` / fp32); ``grad_scale_func``
    scales the last stage's loss before backward (fp16 loss scaling, Megatron's
    ``config.grad_scale_func``).
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    p = ps.get_pipeline_model_parallel_world_size()
    r = ps.get_pipeline_model_parallel_rank()
    v, m = len(chunks), num_microbatches
    name = check_schedule(schedule, p, m, v)
    declared = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    if declared != v:
        # is_pipeline_first_stage()/last_stage() inside the model consult the declared size.
        raise ValueError(f"{v} model chunk(s) given, but initialize_model_parallel was called with "
                         f"virtual_pipeline_model_parallel_size "
                         f"{ps.get_virtual_pipeline_model_parallel_world_size()}; they must agree")
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != v:
            raise ValueError(f"{len(data_iterator)} data iterators for {v} model chunks")
        iterators = list(data_iterator)
    elif v > 1:
        raise ValueError(f"the interleaved schedule needs one data iterator per model chunk "
                         f"(a list of {v}), as in Megatron")
    else:
        iterators = [data_iterator]
    shape = tuple(tensor_shape) if tensor_shape is not None else \
        get_tensor_shape(chunks[0], seq_length, micro_batch_size)
    dtype = dtype or _pipeline_dtype(chunks[0])
    steps = schedule_steps(name, p, r, m, v, forward_only)
    plan = communication_plan(steps, p, r, v)
    last_stage = p * v - 1
    on_gpu = distributed.get_device().type == "cuda"

    def now():
        if on_gpu:
            torch.cuda.synchronize()   # a kernel's time, not its launch
        return time.time()

    # Per chunk, per micro-batch: the stage's input (leaf with requires_grad, or None on the
    # first stage) and output (activation, or scaled loss on the last stage), kept from the
    # forward until the backward — these are the "in-flight activations".
    inputs: List[Dict[int, Optional[torch.Tensor]]] = [{} for _ in range(v)]
    outputs: List[Dict[int, torch.Tensor]] = [{} for _ in range(v)]
    received: Dict[tuple, torch.Tensor] = {}    # (kind, microbatch, chunk) -> message
    produced: Dict[tuple, torch.Tensor] = {}    # (kind, microbatch, stage it enters) -> tensor
    forward_data_store: List[Any] = []
    records: List[tuple] = []
    held = peak = sent = got = 0

    def exchange(boundary):
        nonlocal sent, got
        if not boundary.sends and not boundary.recvs:
            return
        send_next = send_prev = None
        for msg in boundary.sends:
            tensor = produced.pop((msg.kind, msg.microbatch, msg.to_stage))
            if msg.kind == "F":
                send_next = tensor
            else:
                send_prev = tensor
        want = {msg.kind: msg for msg in boundary.recvs}
        from_prev, from_next = p2p.communicate(
            tensor_send_next=send_next, tensor_send_prev=send_prev,
            recv_prev="F" in want, recv_next="B" in want, tensor_shape=shape, dtype=dtype)
        for kind, tensor in (("F", from_prev), ("B", from_next)):
            if kind in want:
                msg = want[kind]
                chunk = (msg.to_stage - r) // p
                received[(kind, msg.microbatch, chunk)] = tensor
        sent += len(boundary.sends)
        got += len(boundary.recvs)

    def forward(mb, chunk):
        nonlocal held, peak
        stage = virtual_stage(chunk, r, p)
        ps.set_virtual_pipeline_model_parallel_rank(chunk)
        input_tensor = received.pop(("F", mb, chunk)) if stage > 0 else None
        _set_input_tensor(chunks[chunk], input_tensor)
        output_tensor, loss_func = forward_step_func(iterators[chunk], chunks[chunk])
        if stage == last_stage:
            loss, reduced = _split_loss(loss_func(output_tensor))
            output_tensor = loss / m      # mean over micro-batches, as Megatron
            forward_data_store.append(reduced)
        else:
            produced[("F", mb, stage + 1)] = output_tensor
        if not forward_only:
            inputs[chunk][mb], outputs[chunk][mb] = input_tensor, output_tensor
            held += 1
            peak = max(peak, held)

    def backward(mb, chunk):
        nonlocal held
        stage = virtual_stage(chunk, r, p)
        ps.set_virtual_pipeline_model_parallel_rank(chunk)
        input_tensor, output_tensor = inputs[chunk].pop(mb), outputs[chunk].pop(mb)
        held -= 1
        if stage == last_stage:
            if grad_scale_func is not None:
                output_tensor = grad_scale_func(output_tensor)
            torch.autograd.backward(output_tensor)
        else:
            grad = received.pop(("B", mb, chunk))
            torch.autograd.backward(output_tensor, grad_tensors=grad.to(output_tensor.dtype))
        # A layer's backward-region tag (comm.tag_backward_output) must not label the sends
        # that follow.
        comm.clear_backward_tag()
        if stage > 0:
            if input_tensor.grad is None:
                raise RuntimeError(f"stage {stage}: its input got no gradient in micro-batch "
                                   f"{mb}; the output must depend on the tensor given to "
                                   f"set_input_tensor()")
            produced[("B", mb, stage - 1)] = input_tensor.grad

    try:
        with torch.set_grad_enabled(not forward_only):
            for i, step in enumerate(steps):
                exchange(plan[i])
                for op in step:
                    start = now() if record_timeline else 0.0
                    (forward if op.kind == "F" else backward)(op.microbatch, op.chunk)
                    if record_timeline:
                        records.append((op.kind, op.microbatch, op.chunk, start, now()))
            exchange(plan[len(steps)])
    finally:
        ps.set_virtual_pipeline_model_parallel_rank(0)
    _LAST_STATS[0] = ScheduleStats(name, r, p, m, v, forward_only, records, peak, sent, got)
    return forward_data_store


# --------------------------------------------------------------------------- Megatron's names
def forward_backward_no_pipelining(**kwargs) -> List[Any]:
    """One stage: forward and backward of each micro-batch in turn (gradient accumulation)."""
    return run_schedule("no-pipelining", **kwargs)


def forward_backward_pipelining_gpipe(**kwargs) -> List[Any]:
    """All forwards, then all backwards (Huang et al. 2019, GPipe): ``m`` activations held."""
    return run_schedule("gpipe", **kwargs)


def forward_backward_pipelining_without_interleaving(**kwargs) -> List[Any]:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021, §2.2.1): at most ``p - r`` held."""
    return run_schedule("1f1b", **kwargs)


def forward_backward_pipelining_with_interleaving(**kwargs) -> List[Any]:
    """Interleaved 1F1B over ``v`` model chunks per stage (Narayanan et al. 2021, §2.2.2)."""
    return run_schedule("interleaved", **kwargs)


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
