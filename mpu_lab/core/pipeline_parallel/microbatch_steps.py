"""One micro-batch through one model chunk, forward and backward: Megatron-core's ``forward_step``
and ``backward_step`` (``pipeline_parallel/schedules.py``), in a module of their own because two
kinds of schedule run them: the loops of :mod:`~mpu_lab.core.pipeline_parallel.schedules` (which
re-exports both) and the action-list runtime of
:mod:`~mpu_lab.core.pipeline_parallel.schedule_runtime`.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from mpu_lab.core import parallel_state as ps
from mpu_lab.core.pipeline_parallel.utils import unwrap_model


def forward_step(forward_step_func: Callable, data_iterator, model: torch.nn.Module,
                 num_microbatches: int, input_tensor: Optional[torch.Tensor],
                 forward_data_store: List[Any], forward_only: bool = False,
                 is_last_stage: Optional[bool] = None):
    """One micro-batch through one model chunk (Megatron's ``forward_step``). On the last stage
    the output is the micro-batch's loss divided by ``num_microbatches``. ``is_last_stage``:
    whether this chunk is the last stage (default: :mod:`parallel_state`'s answer; a V
    schedule, whose last stage is on rank 0, says it itself)."""
    target = unwrap_model(model)
    if hasattr(target, "set_input_tensor"):
        target.set_input_tensor([input_tensor])
    elif input_tensor is not None:
        raise AttributeError(
            f"{type(target).__name__} has no set_input_tensor(): a pipeline stage other than the "
            f"first receives its input through model.set_input_tensor([tensor]) (Megatron)")
    with torch.set_grad_enabled(not forward_only):
        output_tensor, loss_func = forward_step_func(data_iterator, model)
        if ps.is_pipeline_last_stage() if is_last_stage is None else is_last_stage:
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
