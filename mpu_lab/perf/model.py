"""Analytic cost model of model-parallel training (so far: activation memory per layer).

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), §4, Table 2: the bytes one transformer layer keeps for its backward pass,
with 16-bit activations and dropout, for sequence length ``s``, micro-batch ``b``, hidden size
``h``, ``a`` attention heads and tensor-parallel size ``t``:

=====================================  ============================================
no parallelism                         ``s b h (34 + 5 a s / h)``
tensor parallelism                     ``s b h (10 + 24 / t + 5 a s / (h t))``
tensor + sequence parallelism          ``s b h / t (34 + 5 a s / h)``
=====================================  ============================================

The term-by-term derivation (which tensor each number stands for) and a measurement of what
this package's layer really keeps are in :mod:`mpu_lab.models.memory`.
"""
from __future__ import annotations


def activation_memory_per_layer(s: int, b: int, h: int, a: int, t: int = 1,
                                sp: bool = False) -> float:
    """Bytes of activations one transformer layer stores (Korthikanti et al. 2022, Table 2).

    ``t = 1`` gives the no-parallelism row whatever ``sp`` is (all three rows agree there).
    """
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    sbh = s * b * h
    attention = 5 * a * s / h          # the softmax, its dropout mask and the dropout output
    if sp:
        return sbh / t * (34 + attention)
    return sbh * (10 + 24 / t + attention / t)
