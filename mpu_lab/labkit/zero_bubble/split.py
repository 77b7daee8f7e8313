"""The backward of one linear layer split in two (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism", §2): ``B`` computes the input gradient ``dX = dY W`` (the previous stage waits for
it), ``W`` the weight gradient ``dW = dY^T X`` (nobody waits for it before the optimizer step).

:func:`split_one_layer` runs the mirror's linear (``linear_with_grad_accumulation_and_async_
allreduce``, the function under ``ColumnParallelLinear`` / ``RowParallelLinear``) in this
process, once with the whole backward and once under
:func:`~mpu_lab.core.tensor_parallel.linear_autograd.delay_wgrad_compute`, and counts the
FLOPs of each part with torch's ``FlopCounterMode``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from mpu_lab.core.tensor_parallel.linear_autograd import (
    delay_wgrad_compute, linear_with_grad_accumulation_and_async_allreduce)


@dataclasses.dataclass
class SplitResult:
    """What one layer's split backward did: ``tokens`` x ``in_features`` -> ``out_features``."""

    tokens: int
    in_features: int
    out_features: int
    whole_flops: int            # the backward without a split (FlopCounterMode)
    b_flops: int                # B: backward under delay_wgrad_compute
    w_flops: int                # W: the queued GEMMs
    queued: int                 # GEMMs left in the store by B
    weight_grad_after_b: bool   # did the weight have a gradient after B alone?
    input_grad_after_b: bool
    input_grad_equal: bool      # B's dX equals the whole backward's (bit for bit)
    weight_grad_equal: bool     # W's dW equals the whole backward's, and torch's F.linear's

    def report(self) -> str:
        gemm = 2 * self.tokens * self.in_features * self.out_features
        return "\n".join([
            f"one linear layer, X [{self.tokens}, {self.in_features}] -> "
            f"Y [{self.tokens}, {self.out_features}]; one GEMM = 2·{self.tokens}·"
            f"{self.in_features}·{self.out_features} = {gemm:,} FLOPs",
            f"whole backward: {self.whole_flops:,} FLOPs = {self.whole_flops / gemm:g} GEMMs",
            f"B (input gradient):  {self.b_flops:,} FLOPs = {self.b_flops / gemm:g} GEMM; "
            f"after it X.grad {'set' if self.input_grad_after_b else 'MISSING'}, "
            f"W.grad {'set' if self.weight_grad_after_b else 'None'}, "
            f"{self.queued} GEMM queued",
            f"W (weight gradient): {self.w_flops:,} FLOPs = {self.w_flops / gemm:g} GEMM",
            f"dX from B equals the whole backward's: {self.input_grad_equal}; "
            f"dW from W equals it (and F.linear's): {self.weight_grad_equal}",
        ])


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def split_one_layer(tokens: int = 64, in_features: int = 32, out_features: int = 48,
                    seed: int = 0) -> SplitResult:
    """Backward of ``Y = X W^T`` (no bias) three ways from the same ``X``, ``W``, ``dY``: whole,
    and split into B then W; checked against ``torch.nn.functional.linear``'s autograd."""
    for name, value in (("tokens", tokens), ("in_features", in_features),
                        ("out_features", out_features)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(tokens, in_features, generator=g)  # cpu: one process
    w0 = torch.randn(out_features, in_features,
                     generator=g) / in_features ** 0.5  # cpu: one process
    dy = torch.randn(tokens, out_features, generator=g)  # cpu: one process

    def leaves():
        return x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)

    x_ref, w_ref = leaves()                       # torch's own linear: the reference
    F.linear(x_ref, w_ref).backward(dy)

    x_whole, w_whole = leaves()
    y = linear_with_grad_accumulation_and_async_allreduce(x_whole, w_whole, None)
    whole = _flops(lambda: y.backward(dy))

    x, w = leaves()
    y = linear_with_grad_accumulation_and_async_allreduce(x, w, None)
    store: list = []
    delay_wgrad_compute(store)
    try:
        b = _flops(lambda: y.backward(dy))
    finally:
        delay_wgrad_compute(None)
    weight_after_b, input_after_b, queued = w.grad is not None, x.grad is not None, len(store)

    def run_store():
        for gemm in store:
            gemm()
    w_flops = _flops(run_store)
    return SplitResult(
        tokens, in_features, out_features, whole, b, w_flops, queued, weight_after_b,
        input_after_b,
        input_grad_equal=bool(torch.equal(x.grad, x_whole.grad)),
        weight_grad_equal=bool(torch.equal(w.grad, w_whole.grad)
                               and torch.allclose(w.grad, w_ref.grad, rtol=1e-6, atol=1e-6)))
