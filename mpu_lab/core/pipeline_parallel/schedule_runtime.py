"""The runtime that executes a rank's action list: ZB-H1 and ZB-V (Qi et al. 2024, "Zero Bubble
Pipeline Parallelism") and DualPipeV, the schedules of
:mod:`~mpu_lab.core.pipeline_parallel.action_lists`.

Same call as Megatron's schedules (:mod:`~mpu_lab.core.pipeline_parallel.schedules`)::

    forward_backward_func = get_forward_backward_func("ZBVZeroBubble")
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step, data_iterator=[it0, it1], model=[chunk0, chunk1],
        num_microbatches=m, seq_length=s, micro_batch_size=b)

The rank walks its list, one action at a time:

* ``F`` (micro-batch ``i``, chunk ``c``): receive the input from the rank holding the stage
  before (unless this is the first stage, or that stage is this rank's other chunk — the turn
  of a V), run :func:`~mpu_lab.core.pipeline_parallel.microbatch_steps.forward_step`, send it on;
* ``B``: receive the output gradient (none on the last stage: the loss), run
  :func:`~mpu_lab.core.pipeline_parallel.microbatch_steps.backward_step` under
  :func:`~mpu_lab.core.tensor_parallel.linear_autograd.delay_wgrad_compute` — the linear layers
  compute their input gradients and leave their weight-gradient GEMMs in this micro-batch's
  store (the zero-bubble paper's ``WeightGradStore``) — and send the input gradient back;
* ``W``: run that store (:func:`backward_dw`, after Megatron-core's name for it on its
  Transformer Engine layers); ``BW`` (DualPipeV's whole backward): ``backward_step`` as is.

A receive waits right before the action that needs it; a send is started and not waited for
until the end of the call (the runtime of torch's ``_PipelineScheduleRuntime`` does the same).
So a rank blocks only on what its next action needs, and an order that
:func:`mpu_lab.perf.pipeline_schedules.simulate` can play out cannot deadlock. Each message
stream — one direction, one sending chunk — has its own tag, so on gloo the receiver matches
them in micro-batch order (within a stream they are sent in that order). On NCCL, which
matches by posting order instead of tags, the lists would need a posting order agreed between
each pair of ranks; this runtime is written for the CPU (gloo) pipelines of the labs.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from mpu_lab.core import parallel_state as ps
from mpu_lab.core.comm import staging
from mpu_lab.core.pipeline_parallel.action_lists import (
    ACTION_LIST_SCHEDULES, CHUNKS_PER_RANK, STAGE_LAYOUT, Action, rank_actions,
    rank_and_chunk_of, stage_of)
from mpu_lab.core.pipeline_parallel.p2p_communication import ACTIVATION_TAG, GRADIENT_TAG
from mpu_lab.core.pipeline_parallel.microbatch_steps import backward_step, forward_step
from mpu_lab.core.pipeline_parallel.utils import message_shape_and_dtype, model_chunks_of
from mpu_lab.core.tensor_parallel.linear_autograd import delay_wgrad_compute
from mpu_lab.core.utils import get_device


def backward_input(input_tensor, output_tensor, output_tensor_grad, grad_scale_func,
                   wgrad_store: list):
    """B: :func:`backward_step` with the linear layers' weight-gradient GEMMs left in
    ``wgrad_store`` (every other gradient is computed, as autograd computes it)."""
    delay_wgrad_compute(wgrad_store)
    try:
        return backward_step(input_tensor, output_tensor, output_tensor_grad, grad_scale_func)
    finally:
        delay_wgrad_compute(None)


def backward_dw(wgrad_store: list) -> None:
    """W: the weight-gradient GEMMs one B left, in the order it left them."""
    for gemm in wgrad_store:
        gemm()


class _Messages:
    """The rank's side of the pipeline messages of one call: blocking receives, sends started
    and kept until :meth:`wait_sends`. The tag of a stream is ``2 · sending chunk`` plus
    :data:`~mpu_lab.core.pipeline_parallel.p2p_communication.ACTIVATION_TAG` or
    ``GRADIENT_TAG``."""

    def __init__(self, shape, dtype):
        self.group = ps.get_pipeline_model_parallel_group()
        self.ranks = ps.get_group_ranks("pp")
        self.shape, self.dtype, self.device = shape, dtype, get_device()
        self.sends: List[Any] = []

    def send(self, tensor: torch.Tensor, to_pp_rank: int, tag: int) -> None:
        if tuple(tensor.shape) != tuple(self.shape):
            raise ValueError(f"pipeline p2p: tensor of shape {tuple(tensor.shape)} sent where "
                             f"the peer expects {tuple(self.shape)}")
        out = staging.to_backend(tensor.detach().to(self.dtype).contiguous(), self.group)[0]
        self.sends.append((dist.isend(out, self.ranks[to_pp_rank], group=self.group, tag=tag),
                           out))

    def recv(self, from_pp_rank: int, tag: int) -> torch.Tensor:
        buffer = torch.empty(self.shape, dtype=self.dtype,
                             device=staging.backend_device(self.device, self.group))
        dist.irecv(buffer, self.ranks[from_pp_rank], group=self.group, tag=tag).wait()
        return staging.from_backend(buffer, self.device)

    def wait_sends(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends = []


def forward_backward_pipelining_with_action_list(
        schedule: str, *, forward_step_func, data_iterator, model, num_microbatches: int,
        seq_length: int, micro_batch_size: int, forward_only: bool = False,
        tensor_shape=None, dtype=None, grad_scale_func=None,
        action_callback: Optional[Callable[[str, int, int], None]] = None) -> List[Any]:
    """Run ``schedule``'s action list on this pipeline rank (see the module docstring);
    returns the loss dicts of the micro-batches whose loss this rank computed (the last stage:
    rank 0 in a V), ``[]`` elsewhere. ``action_callback(kind, microbatch, chunk)`` is called as
    each action starts (an observer's hook point: it must not touch the tensors)."""
    if schedule not in ACTION_LIST_SCHEDULES:
        raise ValueError(f"no action list for {schedule!r}; choose one of "
                         f"{list(ACTION_LIST_SCHEDULES)}")
    chunks = model_chunks_of(model)
    iterators = list(data_iterator) if isinstance(data_iterator, (list, tuple)) \
        else [data_iterator]
    need = CHUNKS_PER_RANK[schedule]
    if len(chunks) != need or len(iterators) != need:
        raise ValueError(f"{schedule} runs {need} model chunk(s) per rank, each with its own "
                         f"data iterator: got {len(chunks)} chunk(s), {len(iterators)} "
                         f"iterator(s)")
    p, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    layout, num_stages = STAGE_LAYOUT[schedule], p * need
    shape, dtype = message_shape_and_dtype(chunks[0], seq_length, micro_batch_size,
                                           tensor_shape, dtype)
    actions = rank_actions(schedule, p, rank, num_microbatches)
    if forward_only:
        actions = [a for a in actions if a.kind == "F"]
    messages = _Messages(shape, dtype)
    local: Dict[tuple, torch.Tensor] = {}           # the V's turn: (kind, stage, mb) -> tensor
    inputs: Dict[tuple, Optional[torch.Tensor]] = {}
    outputs: Dict[tuple, torch.Tensor] = {}
    wgrad_stores: Dict[tuple, list] = {}            # (chunk, mb) -> what its B left for W
    forward_data_store: List[Any] = []

    def tag(from_stage: int, kind: int) -> int:
        return 2 * rank_and_chunk_of(from_stage, p, layout)[1] + kind

    def hand_over(tensor, kind: str, to_stage: int, from_stage: int, mb: int) -> None:
        """Send to the rank holding ``to_stage``, or keep it here when that is this rank."""
        to_rank = rank_and_chunk_of(to_stage, p, layout)[0]
        if to_rank == rank:
            local[(kind, to_stage, mb)] = tensor.detach()
        else:
            messages.send(tensor, to_rank, tag(from_stage, ACTIVATION_TAG if kind == "F"
                                               else GRADIENT_TAG))

    def take(kind: str, stage: int, from_stage: int, mb: int) -> torch.Tensor:
        """What ``hand_over`` sent to ``stage`` from ``from_stage``."""
        if (kind, stage, mb) in local:
            return local.pop((kind, stage, mb))
        from_rank = rank_and_chunk_of(from_stage, p, layout)[0]
        return messages.recv(from_rank, tag(from_stage, ACTIVATION_TAG if kind == "F"
                                            else GRADIENT_TAG))

    def run(a: Action) -> None:
        stage = stage_of(a.chunk, rank, p, layout)
        key = (a.chunk, a.microbatch)
        if action_callback is not None:
            action_callback(a.kind, a.microbatch, a.chunk)
        if a.kind == "F":
            input_tensor = None if stage == 0 else \
                take("F", stage, stage - 1, a.microbatch).requires_grad_(True)
            output_tensor = forward_step(forward_step_func, iterators[a.chunk], chunks[a.chunk],
                                         num_microbatches, input_tensor, forward_data_store,
                                         forward_only, is_last_stage=stage == num_stages - 1)
            if stage < num_stages - 1:
                hand_over(output_tensor, "F", stage + 1, stage, a.microbatch)
            if not forward_only:
                inputs[key], outputs[key] = input_tensor, output_tensor
        elif a.kind in ("B", "BW"):
            grad = None if stage == num_stages - 1 else \
                take("B", stage, stage + 1, a.microbatch)
            if a.kind == "BW":                 # the whole backward at once (DualPipeV)
                input_grad = backward_step(inputs.pop(key), outputs.pop(key), grad,
                                           grad_scale_func)
            else:
                wgrad_stores[key] = []
                input_grad = backward_input(inputs.pop(key), outputs.pop(key), grad,
                                            grad_scale_func, wgrad_stores[key])
            if stage > 0:
                hand_over(input_grad, "B", stage - 1, stage, a.microbatch)
        elif a.kind == "W":
            backward_dw(wgrad_stores.pop(key))
        else:
            raise ValueError(f"unknown action kind {a.kind!r} in {a}")

    try:
        for a in actions:
            run(a)
    finally:
        messages.wait_sends()
    if wgrad_stores:
        raise RuntimeError(f"the weight gradients of {sorted(wgrad_stores)} (chunk, micro-batch) "
                           f"were never computed: {schedule}'s list has a B without its W")
    return forward_data_store


def forward_backward_pipelining_zero_bubble_h1(**kwargs) -> List[Any]:
    """ZB-H1 (Qi et al. 2024, §3.1): one chunk per rank, 1F1B with weight gradients held
    back to fill the cool-down; see :func:`~mpu_lab.core.pipeline_parallel.action_lists.zbh1_actions`."""
    return forward_backward_pipelining_with_action_list("ZBH1", **kwargs)


def forward_backward_pipelining_dualpipev(**kwargs) -> List[Any]:
    """DualPipeV (DeepSeek-V3's DualPipe in a V; torch's ``ScheduleDualPipeV``): a forward and
    another micro-batch's whole backward paired in its steady state; see
    :func:`~mpu_lab.core.pipeline_parallel.action_lists.dualpipev_actions`."""
    return forward_backward_pipelining_with_action_list("DualPipeV", **kwargs)


def forward_backward_pipelining_zbv(**kwargs) -> List[Any]:
    """ZB-V (Qi et al. 2024, §6): two chunks per rank in a V, first and last stage on rank 0;
    see :func:`~mpu_lab.core.pipeline_parallel.action_lists.zbv_actions`."""
    return forward_backward_pipelining_with_action_list("ZBVZeroBubble", **kwargs)
