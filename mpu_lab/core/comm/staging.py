"""Host staging, the one place it is decided: when several ranks share one GPU, NCCL refuses to
run and the backend is gloo (:func:`mpu_lab.training.initialize.choose_backend`), which takes
CPU tensors only; such a rank's tensors go through host memory and come back. The collectives of
:mod:`mpu_lab.core.comm` and the pipeline's messages
(:mod:`mpu_lab.core.pipeline_parallel.p2p_communication`) all stage this way.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def backend_device(device, group) -> torch.device:
    """Where ``group``'s backend takes a tensor of ``device`` from: host memory for a CUDA
    device on gloo, else ``device`` itself."""
    device = torch.device(device)
    if device.type == "cuda" and dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return device


def to_backend(tensor: torch.Tensor, group):
    """``(tensor the backend can take, device to return the result to or None)``."""
    device = backend_device(tensor.device, group)
    if device != tensor.device:
        return tensor.to(device), tensor.device
    return tensor, None


def from_backend(tensor: torch.Tensor, device) -> torch.Tensor:
    """``tensor`` back on ``device`` (``None``: it never left)."""
    return tensor if device is None else tensor.to(device)
