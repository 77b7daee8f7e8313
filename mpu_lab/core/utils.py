"""Small helpers shared by every layer (Megatron-core keeps its own in ``core/utils.py``):
arithmetic, and the device this rank's tensors live on."""
from __future__ import annotations

from typing import List, Optional, Union

import torch

_DEVICE: Optional[torch.device] = None


def get_device() -> torch.device:
    """The device of this rank's tensors, as ``mpu_lab.training.initialize.init`` chose it (its
    own GPU, a shared GPU or the CPU); the CPU before that. Megatron-core reads
    ``torch.cuda.current_device()`` instead: a rank here may also run on a CPU."""
    return _DEVICE if _DEVICE is not None else torch.device("cpu")


def set_device(device: Union[torch.device, str, None]) -> None:
    """Record this rank's device (``None``: back to the CPU default)."""
    global _DEVICE
    _DEVICE = None if device is None else torch.device(device)


def divisors(n: int) -> List[int]:
    """Every positive divisor of ``n``, ascending: the sizes that split ``n`` evenly
    (``divisors(12) == [1, 2, 3, 4, 6, 12]``)."""
    if n < 1:
        raise ValueError(f"divisors needs a positive integer, got {n}")
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest_multiples(n: int, step: int) -> str:
    """The multiples of ``step`` on either side of ``n``, as an error message suggests them
    (``nearest_multiples(10, 4) == "8 or 12"``; ``"4"`` when the one below is 0)."""
    below, above = n // step * step, (n // step + 1) * step
    return f"{below} or {above}" if below else f"{above}"


class _MakeViewlessTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp):
        out = torch.empty((1,), dtype=inp.dtype, device=inp.device)
        out.data = inp.data            # the same storage, no ._base
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def make_viewless_tensor(inp: torch.Tensor) -> torch.Tensor:
    """Megatron-core's ``make_viewless_tensor``: ``inp`` itself when it is not a view, else a
    tensor on the same storage with no ``._base`` (gradients pass through), so that its
    storage may be swapped (``distribute_saved_activations``)."""
    return inp if inp._base is None else _MakeViewlessTensor.apply(inp)
