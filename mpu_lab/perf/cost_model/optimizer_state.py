"""Bytes per parameter of Megatron's mixed-precision Adam: weights, gradients, optimizer state.

Megatron-core's own figures, from its developer guide, "Distributed Optimizer"
(https://docs.nvidia.com/megatron-core/developer-guide/latest/distrib_optimizer.html), the
table "theoretical number of bytes per parameter" (``d``: the data-parallel size):

    =========================  =====================  =====================
    param / grad dtype         plain optimizer        distributed optimizer
    =========================  =====================  =====================
    16-bit / the same 16-bit   20                     4 + 16/d
    16-bit / fp32              18                     6 + 12/d
    fp32 / fp32                16                     8 + 8/d
    =========================  =====================  =====================

The guide writes "float16" for both 16-bit formats (its ``Float16OptimizerWithFloat16Params``
serves fp16 and bf16 alike: only the width counts), so fp16/fp16 and bf16/bf16 give 20, and
fp16/fp32 and bf16/fp32 give 18. Megatron-LM trains bf16 with fp32 gradients (it sets
``accumulate_allreduce_grads_in_fp32`` for ``--bf16``): the 18 row is its bf16 training.

Where the bytes go (:func:`bytes_per_parameter_terms`):

* the **param** (2 or 4 bytes) and the **grad** (the gradient buffer: 2 bytes in the
  param's 16-bit format, or 4 in fp32) live on every data-parallel rank; the distributed
  optimizer shards neither ("[no] distribute model gradients", "[no] distribute model
  parameters");
* the optimizer state, which the distributed optimizer splits over the d ranks (ZeRO stage 1,
  Rajbhandari et al. 2020): the **fp32 main param** that Adam updates (4 bytes; none when the
  param itself is fp32: "model params already in fp32 are NOT distributed"), the **fp32 main
  grad** it reads (4 bytes when the gradient buffer is 16-bit; an fp32 buffer serves as the
  main grad itself) and Adam's two moments **m** and **v** (4 + 4 bytes).

ZeRO's "16 bytes" (§3.1, K = 12 with 2-byte weights and gradients) is a model of mixed
precision, not what Megatron allocates: Megatron accumulates gradients in an fp32 main-grad
buffer, which ZeRO's count leaves out.

Pure Python: dtypes are matched by name, so a ``torch.dtype`` works without this module
importing torch.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from mpu_lab.perf.cost_model.fsdp import SHARDED_TERMS, check_strategy

__all__ = ["DTYPE_ALIASES", "DTYPE_BYTES", "VALID_DTYPE_PAIRS", "canonical_dtype",
           "bytes_per_parameter_terms", "bytes_per_parameter", "dtype_for_bytes",
           "format_bytes_per_parameter"]

# Every spelling accepted, to the short name used in the table. A torch.dtype is read through
# str(): "torch.float16" -> "float16".
DTYPE_ALIASES = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
}
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
# (params, grads) that Megatron trains with: a 16-bit gradient buffer is in the param's own
# format; fp32 params always have fp32 gradients.
VALID_DTYPE_PAIRS: Tuple[Tuple[str, str], ...] = (
    ("fp16", "fp16"), ("bf16", "bf16"), ("fp16", "fp32"), ("bf16", "fp32"), ("fp32", "fp32"))


def canonical_dtype(dtype, what: str = "dtype") -> str:
    """``"fp16"``, ``"bf16"`` or ``"fp32"`` for a torch dtype or a string such as
    ``"float16"``, ``"bfloat16"``, ``"torch.float32"`` (case ignored). ValueError otherwise."""
    name = str(dtype).strip().lower()
    name = name[len("torch."):] if name.startswith("torch.") else name
    if name not in DTYPE_ALIASES:
        raise ValueError(f"{what} {dtype!r} is not a dtype Megatron's optimizer keeps; valid: "
                         f"a torch dtype (torch.float16, torch.bfloat16, torch.float32) or one "
                         f"of {sorted(DTYPE_ALIASES)}")
    return DTYPE_ALIASES[name]


def _pair(params_dtype, grads_dtype) -> Tuple[str, str]:
    pair = (canonical_dtype(params_dtype, "params_dtype"),
            canonical_dtype(grads_dtype, "grads_dtype"))
    if pair not in VALID_DTYPE_PAIRS:
        valid = ", ".join(f"{p}/{g}" for p, g in VALID_DTYPE_PAIRS)
        raise ValueError(f"params_dtype {params_dtype!r} with grads_dtype {grads_dtype!r} "
                         f"({pair[0]}/{pair[1]}) is not a combination Megatron trains with; "
                         f"valid params/grads: {valid}")
    return pair


def bytes_per_parameter_terms(params_dtype, grads_dtype) -> Dict[str, Dict[str, int]]:
    """The bytes of one parameter by term: ``{"replicated": {...}, "sharded": {...}}``.
    ``replicated`` (every data-parallel rank keeps them): ``param``, ``grad``. ``sharded``
    (the distributed optimizer divides them by d): ``fp32 main param``, ``fp32 main grad``
    (each only where the param or grad is 16-bit), ``Adam m``, ``Adam v``."""
    params, grads = _pair(params_dtype, grads_dtype)
    sharded = {}
    if DTYPE_BYTES[params] < 4:
        sharded["fp32 main param"] = 4
    if DTYPE_BYTES[grads] < 4:
        sharded["fp32 main grad"] = 4
    sharded.update({"Adam m": 4, "Adam v": 4})
    return {"replicated": {"param": DTYPE_BYTES[params], "grad": DTYPE_BYTES[grads]},
            "sharded": sharded}


def bytes_per_parameter(params_dtype, grads_dtype, distributed_optimizer: bool = False,
                        data_parallel_size: int = 1,
                        data_parallel_sharding_strategy: Optional[str] = None) -> float:
    """Bytes per parameter of Megatron's Adam, as in Megatron-core's developer guide,
    "Distributed Optimizer" (see the module docstring for the table and the terms).

    >>> bytes_per_parameter("bf16", "fp32")
    18.0
    >>> bytes_per_parameter("bf16", "fp32", distributed_optimizer=True, data_parallel_size=4)
    9.0

    ``params_dtype`` / ``grads_dtype``: a torch dtype or a name (``"fp16"``, ``"float16"``,
    ``"half"``, ``"bf16"``, ``"bfloat16"``, ``"fp32"``, ``"float32"``, ``"float"``). Without the
    distributed optimizer ``data_parallel_size`` does not change the figure. A combination
    Megatron does not train with (fp32 params with 16-bit grads, fp16 with bf16) raises
    ValueError naming the valid ones.
    """
    if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) \
            or data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got "
                         f"{data_parallel_size!r}")
    terms = bytes_per_parameter_terms(params_dtype, grads_dtype)
    if data_parallel_sharding_strategy is not None:
        # Megatron-FSDP (--data-parallel-sharding-strategy): ZeRO's stages, cost_model/fsdp.py
        if distributed_optimizer:
            raise ValueError("give distributed_optimizer=True or data_parallel_sharding_strategy, "
                             "not both (the strategy 'optim' is the distributed optimizer)")
        split = SHARDED_TERMS[check_strategy(data_parallel_sharding_strategy)]
        return float(sum(v / (data_parallel_size if k in split else 1)
                         for k, v in terms["replicated"].items())
                     + sum(terms["sharded"].values())
                     / (data_parallel_size if "sharded" in split else 1))
    shards = data_parallel_size if distributed_optimizer else 1
    return float(sum(terms["replicated"].values()) + sum(terms["sharded"].values()) / shards)


def dtype_for_bytes(width: int, what: str = "dtype_bytes") -> str:
    """The table's row name for a width in bytes: 2 -> ``"fp16"`` (bf16 gives the same
    figures), 4 -> ``"fp32"`` (for callers that count bytes, such as the cost model)."""
    names = {2: "fp16", 4: "fp32"}
    if width not in names:
        raise ValueError(f"{what} must be 2 (a 16-bit format) or 4 (fp32), got {width!r}")
    return names[width]


def format_bytes_per_parameter(data_parallel_size: int = 8,
                               short: Optional[Dict[str, str]] = None) -> str:
    """The guide's table with its terms written out: what every rank keeps, what the
    distributed optimizer splits, the two figures, and the second one at
    ``data_parallel_size``. ``short`` renames terms (``{"Adam m": "m"}``) for a narrower
    table."""
    d = data_parallel_size
    name = (short or {}).get
    head = ("params / grads", "every rank keeps",
            "the optimizer splits" if short else "the distributed optimizer splits", "plain",
            "distributed", f"at d = {d}")
    rows = []
    for params, grads in (("fp16", "fp16"), ("bf16", "fp32"), ("fp32", "fp32")):
        terms = bytes_per_parameter_terms(params, grads)
        kept, split = sum(terms["replicated"].values()), sum(terms["sharded"].values())
        rows.append((f"{params} / {grads}",
                     " + ".join(f"{v} {k}" for k, v in terms["replicated"].items()),
                     " + ".join(f"{v} {name(k, k)}" for k, v in terms["sharded"].items()),
                     f"{kept + split}", f"{kept} + {split}/d",
                     f"{bytes_per_parameter(params, grads, True, d):.2f}"))
    width = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, width))).rstrip()
                     for r in [head] + rows)
