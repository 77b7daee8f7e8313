"""Lab 05's checks: the lecture's shape table on one rank, the tensor-parallel sizes a layer
accepts, a layer's collectives per step, and Korthikanti et al.'s activation memory."""
from __future__ import annotations

from typing import Any, List, Optional

from mpu_lab.labkit.exercises.common import Verdict, _as_int_list, _unanswered, _verdict
from mpu_lab.models import TransformerConfig, expected_layer_counts, lecture_shapes
from mpu_lab.perf import activation_memory_per_layer


def check_layer_shape(answer: Any, tensor: str, B: int, L: int, D: int, n_H: int,
                      d_tp: int) -> Verdict:
    """Shape of ``tensor`` (a row of the lecture's table, e.g. ``"A"``) on one rank."""
    if _unanswered(answer, f"the shape of {tensor} on one rank, e.g. (B, L, something)"):
        return Verdict(False)
    shapes = lecture_shapes(B, L, D, n_H, d_tp)
    if tensor not in shapes:
        raise ValueError(f"no tensor {tensor!r} in the lecture's table; it has {list(shapes)}")
    expected, per_rank = shapes[tensor]
    given = _as_int_list(answer)
    many = f" (each rank holds {per_rank} of them)" if per_rank > 1 else ""
    return _verdict(given is not None and tuple(given) == expected,
                    f"{tensor} is {expected} on each of the {d_tp} ranks{many}.",
                    f"{answer!r} is not it. Hint: only the dimensions inside the tensor-parallel "
                    f"blocks (D/d_tp for Q, K, V, Z; 4D/d_tp for A, A') are cut; B and L never "
                    f"are, and Out and x' are whole after the all-reduce.")


def valid_tensor_parallel_sizes(hidden_size: int, num_attention_heads: int) -> List[int]:
    """The sizes ``t`` at which :class:`~mpu_lab.models.TransformerConfig` accepts the layer
    (whole heads per rank; the MLP splits too)."""
    config = TransformerConfig(num_layers=1, hidden_size=hidden_size,
                               num_attention_heads=num_attention_heads)
    sizes = []
    for t in range(1, num_attention_heads + 1):
        try:
            config.check(t)
        except ValueError:
            continue
        sizes.append(t)
    return sizes


def check_tensor_parallel_sizes(answer: Any, hidden_size: int, num_attention_heads: int) -> Verdict:
    """Every tensor-parallel size that can split a layer of ``num_attention_heads`` heads."""
    if _unanswered(answer, "the list of every tensor-parallel size that works"):
        return Verdict(False)
    expected = valid_tensor_parallel_sizes(hidden_size, num_attention_heads)
    given = _as_int_list(answer)
    return _verdict(given is not None and sorted(given) == expected,
                    f"t in {expected}: each rank must hold whole heads, so t divides "
                    f"n_H = {num_attention_heads} (and so t <= n_H).",
                    f"{answer!r} is not it. Hint: a head is never cut, so n_H / t must be a "
                    f"whole number.")


def _collective_total(counts: dict, kind: str) -> int:
    return sum(direction.get(kind, 0) for direction in counts.values())


def check_layer_collectives(answer: Any, sequence_parallel: bool, tp: int = 2) -> Verdict:
    """Collectives of one transformer layer per training step, forward plus backward:
    ``(all_reduces, all_gathers, reduce_scatters)``."""
    if _unanswered(answer, "a triple (all_reduces, all_gathers, reduce_scatters)"):
        return Verdict(False)
    counts = expected_layer_counts(sequence_parallel, tp)
    expected = [_collective_total(counts, k) for k in ("all_reduce", "all_gather", "reduce_scatter")]
    given = _as_int_list(answer)
    mode = "with" if sequence_parallel else "without"
    return _verdict(given == expected,
                    f"{mode} sequence parallelism one layer issues {tuple(expected)} per step "
                    f"(all-reduces, all-gathers, reduce-scatters), forward and backward together.",
                    f"{answer!r} is not it. Hint: count the f and g of both blocks, forward and "
                    f"backward; with sequence parallelism f becomes an all-gather and g a "
                    f"reduce-scatter, and each one's backward is the other.")


def check_activation_memory_mib(answer: Any, s: int, b: int, h: int, a: int, t: int = 1,
                                sp: bool = False, rtol: float = 0.01) -> Verdict:
    """Korthikanti et al.'s activation memory of one layer, in MiB (within ``rtol``)."""
    if _unanswered(answer, "a number of MiB"):
        return Verdict(False)
    expected = activation_memory_per_layer(s, b, h, a, t, sp) / 2 ** 20
    try:
        value = float(answer)
    except (TypeError, ValueError):
        value = None
    mode = f"t = {t}" + (" with sequence parallelism" if sp else "")
    return _verdict(value is not None and abs(value - expected) <= rtol * expected,
                    f"{expected:.0f} MiB per layer at {mode}.",
                    f"{answer!r} is not it. Hint: sbh/t (34 + 5as/h) bytes with sequence "
                    f"parallelism, sbh (10 + 24/t + 5as/(ht)) without; 1 MiB = 2^20 bytes.")

