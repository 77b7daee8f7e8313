"""Activation memory of one transformer layer (Korthikanti et al. 2022): its terms, their sum.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198, §4.1) count, per layer, the tensors the backward pass needs, with 16-bit
values (2 bytes) and 1-byte dropout masks::

    attention   QKV input 2sbh, Q and K 4sbh, softmax output 2as^2b, its dropout mask as^2b,
                the dropout output 2as^2b, V 2sbh, projection input 2sbh, dropout mask sbh
    MLP         fc1 input 2sbh, GeLU input 8sbh, fc2 input 8sbh, dropout mask sbh
    LayerNorm   the two inputs 4sbh
    total       sbh (34 + 5as/h)

Under tensor parallelism (§4.2.1) everything *inside* the column/row-parallel pair is split
``t`` ways (``24/t`` and ``5as/(ht)``); the inputs of the two ``f`` operators, the LayerNorms
and the dropouts outside the blocks are replicated on every rank (the ``10``). Sequence
parallelism (§4.2.2) splits those along the sequence, so everything is ``/t`` (Table 2).

Recomputation (§5): selective recomputation of the attention core keeps everything but the
``s x s`` tensors (``sbh (10 + 24/t)`` with TP alone, ``34 sbh / t`` with SP); full
recomputation keeps only the layer's input, ``2 sbh`` (``/t`` with SP, whose input is split).
``recompute=`` selects the mode in :func:`layer_activation_terms` and
:func:`activation_memory_per_layer`.

The constants come from the widths: ``v`` bytes per activation value and ``m`` per dropout-mask
element. Per ``sbh``: 16 values (LayerNorm inputs 2, QKV input 1, Q K V 3, projection input 1,
fc1 input 1, GeLU input 4, fc2 input 4) and 2 masks give ``16v + 2m`` (34 for the paper's
``v = 2, m = 1``; 10 of them, ``4v + 2m``, replicated under TP alone); per ``a s^2 b`` the
softmax output and the dropout output (2 values) and one mask give ``2v + m`` (the 5).

One source of truth: :func:`layer_activation_terms` lists the terms (with keyword switches for
what an implementation does differently: :mod:`mpu_lab.perf.saved_activations` measures this
package's layer against them); :func:`paper_terms` are the paper's;
:func:`activation_memory_per_layer` is their sum, Table 2's closed form.
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Tuple

__all__ = ["Term", "REPLICATED", "SPLIT", "SCORES", "MASKS", "BOOKKEEPING", "CATEGORIES",
           "RECOMPUTE", "ATTENTION_KINDS", "layer_activation_terms", "paper_terms", "total",
           "activation_memory_per_layer"]

Term = Tuple[str, str, int]     # (name, category, bytes)

# Categories, in the order figures stack them.
REPLICATED = "replicated on the TP group"        # inputs of f, LayerNorms, dropout outside
SPLIT = "split by t (inside the TP blocks)"
SCORES = "attention scores (the 5as/h term)"
MASKS = "dropout masks"
BOOKKEEPING = "LayerNorm statistics, causal mask"
CATEGORIES = (REPLICATED, SPLIT, SCORES, MASKS, BOOKKEEPING)
RECOMPUTE = ("none", "selective", "full")        # recompute_granularity (Megatron's None = "none")
# "explicit": softmax(QK^T) kept; "sdpa": a flash kernel (one log-sum-exp per row, no s x s);
# "sdpa_math": SDPA's math fallback (torch on a CPU with dropout_p > 0): the explicit tensors,
# plus the scaled copies of Q and K it multiplies, without the explicit code's bool causal mask
ATTENTION_KINDS = ("explicit", "sdpa", "sdpa_math")


def _div(value: int, t: int, what: str) -> int:
    if value % t:
        raise ValueError(f"{what} = {value} is not divisible by the tensor-parallel size {t}")
    return value // t


def _true_div(value: int, t: int, what: str) -> float:
    return value / t


def layer_activation_terms(s: int, b: int, h: int, a: int, t: int = 1,
                           sequence_parallel: bool = False, *, bytes_per_value: int = 2,
                           dropout: bool = True, attention: str = "explicit",
                           activation: str = "gelu", layernorm_stats: bool = False,
                           causal_mask: bool = False, saves_gathered_input: bool = False,
                           mask_bytes: int = 1, recompute: str = "none",
                           softmax_bytes: Optional[int] = None) -> List[Term]:
    """The activations one layer keeps on one rank, as ``(name, category, bytes)``.

    The defaults are the paper's accounting (16-bit values, 1-byte dropout masks, explicit
    softmax, no recomputation); the sum is :func:`activation_memory_per_layer` exactly. The
    keyword switches describe an implementation: see :mod:`mpu_lab.perf.saved_activations`
    (``mpu_lab_terms``) and :mod:`mpu_lab.perf.recompute` (``lab_terms``). ``recompute``:
    ``"selective"`` drops what the attention core (from Q, K, V to its context) keeps,
    ``"full"`` keeps the layer's input only. ``softmax_bytes``: the kept softmax output's width
    when it differs from the values' (a softmax computed in fp32); ``layernorm_stats``: True
    (4-byte statistics) or their width in bytes. Raises ValueError when ``t`` does not divide a
    split tensor.
    """
    return _terms(s, b, h, a, t, sequence_parallel, _div, bytes_per_value=bytes_per_value,
                  dropout=dropout, attention=attention, activation=activation,
                  layernorm_stats=layernorm_stats, causal_mask=causal_mask,
                  saves_gathered_input=saves_gathered_input, mask_bytes=mask_bytes,
                  recompute=recompute, softmax_bytes=softmax_bytes)


def _terms(s: int, b: int, h: int, a: int, t: int, sequence_parallel: bool,
           div: Callable[[int, int, str], float], *, bytes_per_value: int = 2,
           dropout: bool = True, attention: str = "explicit", activation: str = "gelu",
           layernorm_stats: bool = False, causal_mask: bool = False,
           saves_gathered_input: bool = False, mask_bytes: int = 1,
           recompute: str = "none", softmax_bytes: Optional[int] = None) -> List[Term]:
    # The paper's accounting by default. ``div`` splits a tensor t ways: exactly (_div,
    # raising when t does not divide it) for the term lists, or as a real number (_true_div)
    # for the closed form.
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
    if activation not in ("gelu", "relu"):
        raise ValueError(f"activation must be 'gelu' or 'relu', got {activation!r}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    v, m = bytes_per_value, mask_bytes
    sbh = s * b * h
    split = div(sbh, t, "s*b*h")                                  # inside the TP blocks
    outside = div(sbh, t, "s*b*h") if sequence_parallel else sbh  # LayerNorm, dropout
    if recompute == "full":
        # Korthikanti §5: the checkpoint keeps the layer's input, as the layer received it
        return [("layer input (kept by the checkpoint)",
                 SPLIT if sequence_parallel else REPLICATED, v * outside)]
    f_input = sbh if (not sequence_parallel or saves_gathered_input) else split
    scores = div(a * s * s * b, t, "a*s*s*b")
    terms: List[Term] = [
        ("LayerNorm inputs (2)", REPLICATED, 2 * v * outside),
        ("QKV input (into f)", REPLICATED, v * f_input),
        ("Q, K, V", SPLIT, 3 * v * split),
        ("projection input", SPLIT, v * split),
        ("fc1 input (into f)", REPLICATED, v * f_input),
        ("fc2 input (activation output)", SPLIT, 4 * v * split),
    ]
    if activation == "gelu":     # relu's backward needs only its output, the fc2 input
        terms.append(("GeLU input", SPLIT, 4 * v * split))
    core = recompute != "selective"      # selective: the attention core keeps nothing
    if core and attention in ("explicit", "sdpa_math"):
        terms.append(("softmax output", SCORES, (softmax_bytes or v) * scores))
        if dropout:
            terms += [("attention dropout output", SCORES, v * scores),
                      ("attention dropout mask", MASKS, m * scores)]
        if attention == "sdpa_math":
            terms.append(("scaled Q and K (SDPA math)", SPLIT, 2 * v * split))
    elif core:
        # the flash kernel keeps one log-sum-exp per query row and head, in fp32
        terms.append(("SDPA log-sum-exp", SPLIT, 4 * div(a * s * b, t, "a*s*b")))
    if dropout:
        terms += [("dropout mask after attention", MASKS, m * outside),
                  ("dropout mask after MLP", MASKS, m * outside)]
    if layernorm_stats:
        tokens = div(s * b, t, "s*b") if sequence_parallel else s * b
        width = 4 if layernorm_stats is True else int(layernorm_stats)
        terms.append(("LayerNorm mean and 1/std", BOOKKEEPING, 2 * 2 * width * tokens))
    if causal_mask and core and attention == "explicit":
        terms.append(("causal mask (s x s, bool)", BOOKKEEPING, s * s))
    return terms


def paper_terms(s: int, b: int, h: int, a: int, t: int = 1,
                sequence_parallel: bool = False) -> List[Term]:
    """Korthikanti et al.'s terms: 16-bit values, dropout, Megatron's sequence parallelism."""
    return _terms(s, b, h, a, t, sequence_parallel, _div)


def total(terms: Iterable[Term]) -> int:
    return sum(n for _, _, n in terms)


def activation_memory_per_layer(s: int, b: int, h: int, a: int, t: int = 1,
                                sp: bool = False, recompute: str = "none") -> float:
    """Bytes of activations one transformer layer stores (Korthikanti et al. 2022, Table 2).

    With 16-bit activations and dropout, sequence ``s``, micro-batch ``b``, hidden ``h``,
    ``a`` heads, tensor-parallel size ``t``:

    =====================================  ============================================
    no parallelism                         ``s b h (34 + 5 a s / h)``
    tensor parallelism                     ``s b h (10 + 24 / t + 5 a s / (h t))``
    tensor + sequence parallelism          ``s b h / t (34 + 5 a s / h)``
    + selective recomputation (§5)         ``s b h (10 + 24 / t)``, with SP ``34 s b h / t``
    + full recomputation (§5)              ``2 s b h``, with SP ``2 s b h / t``
    =====================================  ============================================

    ``t = 1`` gives the no-parallelism row whatever ``sp`` is (all three rows agree there).
    Computed as the sum of :func:`paper_terms`, with the split tensors divided by ``t`` as
    real numbers, so a ``t`` that does not divide them still gives the formula's value.
    """
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return float(total(_terms(s, b, h, a, t, sp, _true_div, recompute=recompute)))
