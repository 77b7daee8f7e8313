"""The optimizer: AdamW over fp32 parameters with Megatron's two parameter groups (weight decay
on the matrices, none on biases and LayerNorm parameters); the part of Megatron-core's
``core/optimizer/__init__.py`` (``get_megatron_optimizer``, ``_get_param_groups``) this lab
uses, without the distributed optimizer or fp16 master copies (mixed precision here is
``torch.autocast``, so the optimizer always sees fp32)."""
from __future__ import annotations

import torch


def build_optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and LayerNorm parameters (1-D), as Megatron."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.dim() == 1 else decay).append(p)
    groups = [dict(params=decay, weight_decay=args.weight_decay),
              dict(params=no_decay, weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_eps)
