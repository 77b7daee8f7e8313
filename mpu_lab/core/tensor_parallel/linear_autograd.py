"""The linear layers' own autograd function, after Megatron-core's
``LinearWithGradAccumulationAndAsyncCommunication`` (``megatron/core/tensor_parallel/layers.py``,
tag core_v0.19.2): a hand-written mirror for teaching, on :mod:`mpu_lab.core.comm`'s collectives.

Why a function of its own, rather than ``F.linear`` after a gather:

* **Memory.** Under sequence parallelism the layer's input is this rank's block of the sequence,
  ``[s/t, b, h]``. Gathering it and handing ``[s, b, h]`` to ``F.linear`` makes autograd keep the
  gathered tensor for the weight gradient: t times the activation memory sequence parallelism
  exists to save (Korthikanti et al. 2022, §4.2.2). This function keeps only the block and
  gathers it again in backward.
* **Overlap.** In backward, every collective is started asynchronously and the gradient GEMMs run
  while it is in flight (on gloo the collective runs on its own thread, on NCCL on its own stream).

Backward, step by step (``X`` the input, ``W`` the weight shard, ``dY`` the output gradient):

1. Sequence parallel: start the all-gather of the saved block ``X_i`` -> ``X`` (async).
2. ``dX = dY W``: the input gradient, computed while that gather runs.
3. Wait for the gather: the full ``X`` is needed for the weight gradient.
4. Start the reduction of ``dX`` (async): a reduce-scatter along the sequence under sequence
   parallelism (each rank gets the gradient of its own block), an all-reduce otherwise (this is
   f's backward, folded into the layer so it can overlap).
5. ``dW = dY^T X`` (and ``db = sum dY``) while ``dX`` is being reduced; with
   ``gradient_accumulation_fusion`` it is added straight into ``W.main_grad`` in fp32 (Megatron's
   ``--gradient-accumulation-fusion``; there a fused CUDA kernel does it) and ``W.grad`` stays
   empty.
6. Wait for the reduction and return ``dX``. (``async_comm=False`` waits at steps 1 and 4 at
   once: lab 09's serial baseline; Megatron's ``--no-async-tensor-model-parallel-allreduce``.)

Split backward (zero bubble, Qi et al. 2024 §2; Megatron-core's ``delay_wgrad_compute``): while
:func:`delay_wgrad_compute` holds a list, step 5's GEMM is appended to it, to run at the ``W``.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from mpu_lab.core import comm, parallel_state

_wgrad_store: Optional[list] = None      # see delay_wgrad_compute


def delay_wgrad_compute(store: Optional[list]) -> None:
    """From now on, backward's weight-gradient GEMMs go to ``store``; ``None``: run them again."""
    global _wgrad_store
    _wgrad_store = store


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``Y = X W^T + b`` for a tensor-parallel linear; see the module docstring for backward.

    ``allreduce_dgrad``: all-reduce the input gradient over the tensor-parallel group (a column-
    parallel layer without sequence parallelism: f's backward). ``sequence_parallel``: ``X`` is
    this rank's ``[s/t, ...]`` block; gather it (dim 0) forward and again in backward, and
    reduce-scatter the input gradient. ``group``: the tensor-parallel group (default: this
    rank's). ``async_comm``: overlap backward's collectives with its GEMMs.
    """

    @staticmethod
    def forward(ctx, input_, weight, bias, gradient_accumulation_fusion: bool,
                allreduce_dgrad: bool, sequence_parallel: bool, group=None, async_comm=True):
        if gradient_accumulation_fusion and not hasattr(weight, "main_grad"):
            raise RuntimeError("gradient_accumulation_fusion=True needs weight.main_grad (an "
                               "fp32 buffer the weight gradient is added to, as Megatron's DDP "
                               "gives every parameter); this weight has none")
        ctx.save_for_backward(input_, weight)    # the block only, under sequence parallelism
        ctx.use_bias = bias is not None
        ctx.fusion, ctx.allreduce_dgrad = gradient_accumulation_fusion, allreduce_dgrad
        ctx.sequence_parallel, ctx.group, ctx.async_comm = sequence_parallel, group, async_comm
        ctx.bias_dtype = bias.dtype if bias is not None else None
        total_input = comm.all_gather(input_, group=group, dim=0) if sequence_parallel else input_
        # F.linear, as torch.nn.Linear: under torch.autocast (mpu_lab's --fp16 / --bf16) the
        # product is computed in the autocast dtype, and backward then gets a 16-bit dY
        return F.linear(total_input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        saved_input, saved_weight = ctx.saved_tensors
        # The GEMMs run in dY's dtype (16-bit under autocast, as the forward's product was);
        # each gradient is returned in the dtype of what it is the gradient of.
        compute = grad_output.dtype
        input_, weight = saved_input.to(compute), saved_weight.to(compute)
        group = ctx.group
        gather = (comm.all_gather_async(input_, group=group, dim=0)    # 1. re-gather, async
                  if ctx.sequence_parallel else None)
        if gather is not None and not ctx.async_comm:
            gather.wait()                                                # serial: done first
        grad_input = grad_output.matmul(weight)                          # 2. while it runs
        total_input = input_
        if gather is not None:                                           # 3.
            total_input = gather.wait()
        reduce: Optional[comm.Pending] = None                            # 4. reduce dX, async
        if ctx.sequence_parallel:
            reduce = comm.reduce_scatter_async(grad_input, group=group, dim=0)
        elif ctx.allreduce_dgrad:
            reduce = comm.all_reduce_async(grad_input, group=group)
        if reduce is not None and not ctx.async_comm:
            reduce.wait()                                                # serial: done first
        dy = grad_output.reshape(-1, grad_output.shape[-1])              # 5. dW while it runs
        x = total_input.reshape(-1, total_input.shape[-1])
        if _wgrad_store is not None:       # the split backward: dW waits for the W (see above)
            _wgrad_store.append(functools.partial(_add_wgrad, saved_weight, dy, x, ctx.fusion))
            grad_weight = None
        elif ctx.fusion:
            saved_weight.main_grad.add_(dy.t().float().matmul(x.float()))
            grad_weight = None
        else:
            grad_weight = dy.t().matmul(x).to(saved_weight.dtype)
        grad_bias = dy.sum(dim=0).to(ctx.bias_dtype) if ctx.use_bias else None
        if reduce is not None:                                           # 6.
            grad_input = reduce.wait()
        return (grad_input.to(saved_input.dtype), grad_weight, grad_bias,
                None, None, None, None, None)


def _add_wgrad(weight, dy, x, fusion: bool) -> None:
    """A deferred step 5, added where autograd (or the fusion) would have added it."""
    grad = dy.t().float().matmul(x.float()) if fusion else dy.t().matmul(x).to(weight.dtype)
    if fusion or weight.grad is not None:
        (weight.main_grad if fusion else weight.grad).add_(grad)
    else:
        weight.grad = grad


def linear_with_grad_accumulation_and_async_allreduce(
        input_: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
        gradient_accumulation_fusion: bool = False, allreduce_dgrad: bool = False,
        sequence_parallel: bool = False, group=None, async_comm: bool = True) -> torch.Tensor:
    """Megatron's entry point to :class:`LinearWithGradAccumulationAndAsyncCommunication`
    (same name, same meaning of the flags; ``async_comm``: see the module docstring)."""
    if group is None and (allreduce_dgrad or sequence_parallel):
        group = parallel_state.get_tensor_model_parallel_group()
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input_, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
        group, async_comm)
