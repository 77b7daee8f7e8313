"""Gradient clipping by the global L2 norm of a tensor- and pipeline-parallel model: each
gradient counted once over the model-parallel group (Megatron-core's
``core/optimizer/clip_grads.py``: ``get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32``)."""
from __future__ import annotations

import torch

from mpu_lab.core import comm
from mpu_lab.core.tensor_parallel import param_is_not_tensor_parallel_duplicate


def clip_grad_norm(parameters, max_norm: float, model_parallel_group=None,
                   expert_parallel_group=None) -> float:
    """Global L2 norm of the gradients of a tensor-parallel model, then clip to ``max_norm``.

    A split parameter contributes its shard on every rank; a replicated one (LayerNorm,
    position embedding, row-parallel bias) only on tensor-parallel rank 0, and the last
    pipeline stage's copy of the tied embedding (marked ``shared``) not at all — its gradient
    is the first stage's — so nothing is counted twice; the squares are summed over the
    model-parallel group, tensor x pipeline (Megatron's ``get_grad_norm_fp32``).

    Mixture of experts (``expert_parallel_group`` given): the expert parameters (marked
    ``allreduce = False``) are held by other ranks — each expert on one expert-parallel rank,
    sliced over the expert-tensor-parallel ones — so their squares are summed over that group
    (Megatron's expert tp-ep-pp group) and added to the dense ones.
    ``max_norm = 0`` only measures. Every parameter is clipped.
    """
    params = [p for p in parameters if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    experts = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if expert_parallel_group is not None and not getattr(p, "allreduce", True):
            experts += p.grad.detach().float().pow(2).sum()
        elif param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False):
            total += p.grad.detach().float().pow(2).sum()
    if model_parallel_group is not None and comm.group_size(model_parallel_group) > 1:
        total = comm.all_reduce(total, group=model_parallel_group)
    if expert_parallel_group is not None:
        if comm.group_size(expert_parallel_group) > 1:
            experts = comm.all_reduce(experts, group=expert_parallel_group)
        total = total + experts
    norm = float(total.sqrt())
    if max_norm > 0:
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            for p in params:
                p.grad.detach().mul_(coeff)
    return norm
