"""Megatron-FSDP's four sharding strategies on paper: what each keeps per data-parallel rank
and what it moves per step (ZeRO, Rajbhandari et al. 2020, §5 and Fig. 1; Megatron-core's
``--data-parallel-sharding-strategy``). Pure: no torch.

Memory: ZeRO's three stages divide, in turn, the optimizer states (``optim``, stage 1), the
gradients (``optim_grads``, stage 2) and the parameters (``optim_grads_params``, stage 3) by
the data-parallel size ``d``. In the terms of Megatron's table
(:func:`~mpu_lab.perf.cost_model.optimizer_state.bytes_per_parameter_terms`): ``optim`` shards
the ``sharded`` terms (fp32 main copies, Adam's moments), ``optim_grads`` the ``grad`` term too,
``optim_grads_params`` the ``param`` term too (:data:`SHARDED_TERMS`).

Communication per step and rank, for ``Ψ`` gradient bytes and ring collectives (Patarasuk &
Yuan 2009): an all-reduce moves ``2(d-1)/d Ψ``, a reduce-scatter and an all-gather
``(d-1)/d Ψ`` each. ``no_shard`` all-reduces the gradients; ``optim`` and ``optim_grads``
reduce-scatter them and all-gather the updated parameters — the same ``2(d-1)/d Ψ``;
``optim_grads_params`` all-gathers the parameters twice (forward, backward) and
reduce-scatters once: ``3(d-1)/d Ψ``, 1.5 x (ZeRO §7.2.2).
"""
from __future__ import annotations

from typing import Dict, Tuple

# the strategies, as mpu_lab.core.distributed.fsdp names them (a test ties the two)
DATA_PARALLEL_SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")

# strategy -> the terms of bytes_per_parameter_terms it divides by d
SHARDED_TERMS: Dict[str, Tuple[str, ...]] = {
    "no_shard": (),
    "optim": ("sharded",),
    "optim_grads": ("sharded", "grad"),
    "optim_grads_params": ("sharded", "grad", "param"),
}

# collectives per step, in multiples of (d-1)/d x the gradient bytes
_RING_MULTIPLES = {"no_shard": 2, "optim": 2, "optim_grads": 2, "optim_grads_params": 3}


def check_strategy(strategy: str) -> str:
    if strategy not in SHARDED_TERMS:
        raise ValueError(f"data_parallel_sharding_strategy must be one of "
                         f"{', '.join(DATA_PARALLEL_SHARDING_STRATEGIES)}; got {strategy!r}")
    return strategy


def ring_bytes(kind: str, input_bytes: float, group_size: int) -> float:
    """The bytes one rank sends through its link for a ring collective whose input on that
    rank is ``input_bytes`` (what ``CommDebugMode`` sees): ``all_reduce`` ``2(n-1)/n`` of it,
    ``reduce_scatter`` ``(n-1)/n`` of it (the input is the whole buffer), ``all_gather``
    ``(n-1)`` times it (the input is this rank's shard)."""
    n = group_size
    factors = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "all_gather": float(n - 1)}
    if kind not in factors:
        raise ValueError(f"kind must be one of {', '.join(factors)}; got {kind!r}")
    return factors[kind] * input_bytes


def data_parallel_bytes_per_step(strategy: str, gradient_bytes: float,
                                 data_parallel_size: int) -> float:
    """Bytes one rank moves per step for the data-parallel side of ``strategy``:
    ``2(d-1)/d Ψ`` (``no_shard``, ``optim``, ``optim_grads``) or ``3(d-1)/d Ψ``
    (``optim_grads_params``), ``Ψ = gradient_bytes`` (padded buffers, one micro-batch)."""
    d = data_parallel_size
    return _RING_MULTIPLES[check_strategy(strategy)] * (d - 1) / d * gradient_bytes


def resident_bytes_per_rank(strategy: str, numel: int, data_parallel_size: int,
                            param_bytes: int = 4, grad_bytes: int = 4,
                            optimizer_bytes: int = 8) -> Dict[str, float]:
    """``{"param_bytes", "grad_bytes", "optimizer_state_bytes"}`` a rank keeps for ``numel``
    elements (padded as the buffers are) under ``strategy``: each term whole or divided by
    ``d``. The defaults are fp32 parameters and gradients and Adam's two fp32 moments; the
    count of a real run adds AdamW's 4-byte ``step`` per stepped tensor."""
    sharded = SHARDED_TERMS[check_strategy(strategy)]
    d = data_parallel_size
    return dict(param_bytes=numel * param_bytes / (d if "param" in sharded else 1),
                grad_bytes=numel * grad_bytes / (d if "grad" in sharded else 1),
                optimizer_state_bytes=numel * optimizer_bytes / (d if "sharded" in sharded else 1))
