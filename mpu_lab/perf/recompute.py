"""Activation recomputation, measured against Korthikanti et al. 2022 (§5): the bytes autograd
keeps per layer under no, selective and full recomputation, with dropout on, and the FLOPs a
training step pays for them.

Saved bytes: :func:`measure_saved_bytes` runs one ``TransformerBlock`` (or
:func:`measure_gpt_saved_bytes` a small ``GPTModel``) forward with Megatron-core's
``recompute_*`` fields (:data:`MODES`: ``"selective"`` recomputes the attention core, ``"full"``
checkpoints each layer, ``recompute_method="uniform"``, ``recompute_num_layers=1``) and counts
what autograd saves (:class:`~mpu_lab.perf.saved_activations.SavedTensors`: unique storages,
parameters left out). :func:`lab_terms` is the paper's term list with the constants of what
this lab runs:

* ``v`` bytes per activation value: 4 in fp32 (the paper: 2, 16-bit);
* ``m`` bytes per dropout-mask element (:func:`mask_bytes`): torch on a CPU multiplies by a
  scaled Bernoulli noise tensor of the input's dtype and keeps it, 4 bytes in fp32; on CUDA
  the fused ``native_dropout`` keeps a bool mask, 1 byte, the paper's;
* the attention kernel (:func:`attention_kind`): the explicit softmax keeps the ``s x s``
  scores; SDPA keeps them too on a CPU when ``dropout_p > 0`` (torch falls back to its math
  path, which also keeps scaled copies of Q and K), and keeps none with dropout 0 (the flash
  kernel: one log-sum-exp per row);
* LayerNorm's mean and 1/std (``[s, b]`` each, fp32; the input's width on a CPU) and the
  explicit code's bool causal mask, which the paper neglects; in 16-bit the explicit code keeps
  its softmax in fp32 (``4 + v + m`` per ``as^2b``: 7 in bf16 on CUDA, not the paper's 5).

So per ``sbh``: ``16v + 2m`` (the paper's 34; 72 here), of which ``4v + 2m`` are replicated
under TP alone (10; 24 here) and ``12v`` split (24; 48 here); per ``as^2b/t``: ``2v + m`` (5; 12
here). Selective recomputation keeps ``sbh (16v + 2m)`` (/t with SP); full the layer's input,
``v sbh`` (/t with SP). :func:`formulas` writes them out for any ``v, m``.

FLOPs: :func:`count_step_flops` counts one forward and backward with
``torch.utils.flop_counter.FlopCounterMode`` (its backward counts the recomputed forward too);
:func:`step_flops_formula` is the hand-worked count: a layer's forward is ``24 sbh^2/t`` in its
four linear layers plus ``4 b s^2 h/t`` in the attention core (``QK^T`` and the weighted sum,
the whole ``s x s``); a step is 3 forwards, plus one more forward of the layer (full) or of the
attention core (selective). torch's counter has no formula for the CPU flash kernel (SDPA with
dropout 0 on a CPU) and counts its attention as 0 FLOPs: measure with the explicit attention
or with dropout on.

``launch/activation_memory.py --recompute`` runs the measurement at TP = 2 with and without SP.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch.utils.flop_counter import FlopCounterMode

from mpu_lab.core import parallel_state
from mpu_lab.core.models.gpt import GPTModel
from mpu_lab.core.tensor_parallel import model_parallel_manual_seed
from mpu_lab.core.transformer import TransformerBlock, TransformerConfig
from mpu_lab.perf.cost_model import ModelShape, hardware_flops_per_iteration
from mpu_lab.perf.cost_model.activations import (
    BOOKKEEPING, MASKS, RECOMPUTE, REPLICATED, SPLIT, Term, activation_memory_per_layer,
    layer_activation_terms, total)
from mpu_lab.perf.saved_activations import SavedTensors
from mpu_lab.training import initialize

__all__ = ["MODES", "mask_bytes", "attention_kind", "lab_terms", "formulas", "recompute_config",
           "measure_saved_bytes", "saved_bytes_row", "format_saved_bytes", "format_formulas",
           "gpt_outside_terms", "measure_gpt_saved_bytes", "format_gpt", "count_step_flops",
           "step_flops_formula", "flops_row", "format_flops"]

# Megatron-core's fields for each mode (full: every layer its own checkpoint)
MODES: Dict[str, dict] = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}
DROPOUT = 0.1


def mask_bytes(device, dtype: torch.dtype = torch.float32) -> int:
    """Bytes torch keeps per dropout-mask element on ``device``: 1 on CUDA (the fused
    ``native_dropout``'s bool mask), else the activation's width (the scaled noise, measured:
    4 in fp32, 2 in bf16)."""
    return 1 if torch.device(device).type == "cuda" else torch.finfo(dtype).bits // 8


def attention_kind(attention_impl: str, dropout: bool, device="cpu") -> str:
    """Which of the cost model's attention kinds runs: ``"explicit"``; ``"sdpa"`` (a flash
    kernel); ``"sdpa_math"`` (SDPA with dropout on a CPU falls back to its math path)."""
    if attention_impl == "explicit":
        return "explicit"
    return "sdpa_math" if dropout and torch.device(device).type == "cpu" else "sdpa"


def lab_terms(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
              recompute: str = "none", attention_impl: str = "explicit", dropout: bool = True,
              dtype: torch.dtype = torch.float32, device="cpu") -> List[Term]:
    """The terms of this package's layer, byte for byte what :func:`measure_saved_bytes` finds
    (GeLU; Megatron's column-parallel linear keeps its local ``[s/t, b, h]`` input with SP).
    In 16-bit the explicit attention keeps its softmax in fp32 (it computes it in fp32, as
    Megatron's ``attention_softmax_in_fp32``), and LayerNorm's statistics are fp32 on CUDA
    (torch's accumulation type) but of the input's width on a CPU; SDPA's math fallback in
    16-bit computes in fp32 and is not derived here (ValueError). Measured on a CPU in fp32
    and bf16; the CUDA constants are read from torch's kernels, not measured here."""
    v = torch.finfo(dtype).bits // 8
    kind = attention_kind(attention_impl, dropout, device)
    if kind == "sdpa_math" and v != 4:
        raise ValueError(f"SDPA's CPU math path with dropout computes in fp32 whatever the dtype; "
                         f"lab_terms derives it for float32 only, got {dtype}: use "
                         f"attention_impl='explicit' or dropout off")
    cuda = torch.device(device).type == "cuda"
    return layer_activation_terms(
        s, b, h, a, t, sequence_parallel, bytes_per_value=v, dropout=dropout, attention=kind,
        layernorm_stats=4 if cuda else v, causal_mask=True, mask_bytes=mask_bytes(device, dtype),
        recompute=recompute, softmax_bytes=4 if kind == "explicit" else None)


def formulas(v: int = 4, m: int = 4, attention: str = "explicit",
             softmax: Optional[int] = None) -> Dict[str, str]:
    """Korthikanti's closed forms with the constants for ``v``-byte values, ``m``-byte masks and
    a ``softmax``-byte kept softmax (default ``v``); ``v = 2, m = 1``: the paper's. LayerNorm
    statistics, the causal mask and a flash kernel's log-sum-exp are not included."""
    rep, split = 4 * v + 2 * m, 12 * v + (2 * v if attention == "sdpa_math" else 0)
    c = (softmax or v) + v + m
    scores = f" + {c}as/h" if attention != "sdpa" else ""
    return {"none, TP": f"sbh({rep} + {split}/t" + (f" + {c}as/(ht))" if scores else ")"),
            "none, TP+SP": f"sbh({rep + split}{scores})/t" if scores else f"{rep + split}sbh/t",
            "selective, TP": f"sbh({rep} + {12 * v}/t)",
            "selective, TP+SP": f"{16 * v + 2 * m}sbh/t",
            "full, TP": f"{v}sbh", "full, TP+SP": f"{v}sbh/t"}


# (title, formulas(...) arguments): the paper's, what the lab measures, what a GPU would keep
IMPLEMENTATIONS = (
    ("paper: 16-bit values, 1-byte masks, 16-bit softmax", (2, 1)),
    ("lab, fp32 on a CPU, explicit softmax (measured)", (4, 4)),
    ("lab, fp32 on a CPU, SDPA with dropout = math path (measured)", (4, 4, "sdpa_math")),
    ("lab, bf16 on CUDA, explicit (softmax in fp32; derived)", (2, 1, "explicit", 4)),
    ("lab, bf16 on CUDA, SDPA = flash, no s x s (derived)", (2, 1, "sdpa")),
)


def format_formulas() -> str:
    """Per layer and rank, each implementation's constants (lines under 100 characters)."""
    lines = []
    for title, args in IMPLEMENTATIONS:
        f = formulas(*args)
        lines.append(title)
        lines += [f"  {mode:<10} TP {f[mode + ', TP']:<28} TP+SP {f[mode + ', TP+SP']}"
                  for mode in MODES]
    lines.append("the lab adds LayerNorm's mean and 1/std 16sb on CPU fp32 and CUDA (/t with SP; "
                 "none with full),")
    lines.append("the explicit softmax's bool causal mask s^2 (none only), a flash kernel's "
                 "log-sum-exp 4asb/t")
    return "\n".join(lines)


# --------------------------------------------------------------------------- measuring bytes
def recompute_config(h: int, a: int, recompute: str = "none", num_layers: int = 1,
                     sequence_parallel: bool = False, attention_impl: str = "explicit",
                     dropout: float = DROPOUT, dtype: torch.dtype = torch.float32
                     ) -> TransformerConfig:
    """A ``TransformerConfig`` with Megatron-core's fields for ``recompute`` (:data:`MODES`)."""
    if recompute not in MODES:
        raise ValueError(f"recompute must be one of {tuple(MODES)}, got {recompute!r}")
    return TransformerConfig(num_layers=num_layers, hidden_size=h, num_attention_heads=a,
                             hidden_dropout=dropout, attention_dropout=dropout,
                             sequence_parallel=sequence_parallel, attention_impl=attention_impl,
                             params_dtype=dtype, **MODES[recompute])


def _ready(seed: int) -> int:
    if not parallel_state.model_parallel_is_initialized():
        initialize.init_single_process()
    model_parallel_manual_seed(seed)           # the default and the tensor-parallel streams
    return parallel_state.get_tensor_model_parallel_world_size()


def measure_saved_bytes(s: int, b: int, h: int, a: int, recompute: str = "none",
                        sequence_parallel: bool = False, attention_impl: str = "explicit",
                        dropout: float = DROPOUT, seed: int = 0,
                        dtype: torch.dtype = torch.float32) -> SavedTensors:
    """What autograd keeps for one layer's backward on this rank (a one-layer
    ``TransformerBlock`` in ``dtype``, training mode, input ``[s, b, h]`` or ``[s/t, b, h]``
    with SP)."""
    t = _ready(seed)
    config = recompute_config(h, a, recompute, 1, sequence_parallel, attention_impl, dropout,
                              dtype)
    config.check(t, s)
    block = TransformerBlock(config, post_process=False).train()
    x = torch.randn(s // t if sequence_parallel else s, b, h, device=initialize.get_device(),
                    dtype=dtype, requires_grad=True)
    with SavedTensors(exclude=block.parameters()) as saved:
        block(x)
    return saved


def saved_bytes_row(s: int, b: int, h: int, a: int, recompute: str, sequence_parallel: bool = False,
                    attention_impl: str = "explicit", saved: Optional[SavedTensors] = None
                    ) -> Dict[str, object]:
    """One row: measured on this rank, the lab's derived terms, the paper's bf16 formula."""
    saved = saved or measure_saved_bytes(s, b, h, a, recompute, sequence_parallel, attention_impl)
    t = parallel_state.get_tensor_model_parallel_world_size()
    terms = lab_terms(s, b, h, a, t, sequence_parallel, recompute, attention_impl,
                      device=initialize.get_device())
    return dict(tp=t, sequence_parallel=sequence_parallel, recompute=recompute,
                attention=attention_impl, measured=saved.bytes, derived=total(terms),
                paper=activation_memory_per_layer(s, b, h, a, t, sequence_parallel, recompute),
                terms=terms)


def format_saved_bytes(rows: List[Dict[str, object]], s: int, b: int, h: int, a: int) -> str:
    """The table: bytes one layer keeps on one rank, per mode, measured and derived."""
    sbh = s * b * h
    lines = [f"one layer, dropout {DROPOUT}, s={s} b={b} h={h} a={a} (as/h = {a * s / h:g}); "
             f"bytes on one rank",
             f"{'config':<12}{'attention':<10}{'recompute':<11}{'measured':>10}{'derived':>10}"
             f"{'/sbh':>8}{'paper bf16':>12}{'/sbh':>7}"]
    for r in rows:
        name = f"TP={r['tp']}" + ("+SP" if r["sequence_parallel"] else "")
        lines.append(f"{name:<12}{r['attention']:<10}{r['recompute']:<11}{r['measured']:>10}"
                     f"{r['derived']:>10}{r['measured'] / sbh:>8.2f}{round(r['paper']):>12}"
                     f"{r['paper'] / sbh:>7.2f}")
    return "\n".join(lines)


def gpt_outside_terms(s: int, b: int, h: int, vocab_size: int, v: int = 4, m: int = 4
                      ) -> List[Term]:
    """What a one-rank ``GPTModel`` keeps outside its layers (any recompute mode): the embedding's
    ids and positions (int64) and dropout mask, the final LayerNorm's input and statistics, the
    output layer's input, ``F.cross_entropy``'s log-softmax (fp32), targets (int64) and total
    weight (a 0-dim fp32)."""
    sbh = s * b * h
    return [("input ids, positions (int64)", BOOKKEEPING, 8 * b * s + 8 * s),
            ("embedding dropout mask", MASKS, m * sbh),
            ("final LayerNorm input", REPLICATED, v * sbh),
            ("final LayerNorm mean and 1/std", BOOKKEEPING, 2 * 4 * s * b),
            ("output layer input", REPLICATED, v * sbh),
            ("log-softmax of the logits (fp32)", SPLIT, 4 * s * b * vocab_size),
            ("targets (int64), total weight", BOOKKEEPING, 8 * s * b + 4)]


def measure_gpt_saved_bytes(s: int, b: int, h: int, a: int, num_layers: int, vocab_size: int,
                            recompute: str = "none", attention_impl: str = "explicit",
                            seed: int = 0) -> SavedTensors:
    """What autograd keeps for a ``GPTModel``'s backward (forward with labels, training mode)."""
    _ready(seed)
    config = recompute_config(h, a, recompute, num_layers, attention_impl=attention_impl)
    model = GPTModel(config, vocab_size, s).train()
    g = torch.Generator().manual_seed(seed)           # the same tokens on any device
    device = initialize.get_device()
    ids, labels = (torch.randint(0, vocab_size, (b, s), generator=g)  # cpu: CPU generator
                   .to(device) for _ in range(2))
    with SavedTensors(exclude=model.parameters()) as saved:
        model(ids, labels=labels)
    return saved


def format_gpt(s: int, b: int, h: int, a: int, num_layers: int, vocab_size: int,
               attention_impl: str = "explicit") -> str:
    """A one-rank ``GPTModel`` per mode: saved bytes (measured; derived as L layers of
    :func:`lab_terms` + :func:`gpt_outside_terms`) and step FLOPs (counted; the cost model's
    :func:`~mpu_lab.perf.cost_model.hardware_flops_per_iteration`, Narayanan et al. 2021)."""
    shape = ModelShape(num_layers=num_layers, hidden_size=h, num_attention_heads=a,
                       seq_length=s, vocab_size=vocab_size)
    outside = total(gpt_outside_terms(s, b, h, vocab_size))
    lines = [f"GPTModel, one rank, L={num_layers} s={s} b={b} h={h} a={a} V={vocab_size}, "
             f"dropout {DROPOUT}, {attention_impl}; outside the layers {outside} bytes",
             f"{'recompute':<11}{'saved':>12}{'derived':>12}{'FLOPs':>14}{'cost model':>14}"]
    for mode in MODES:
        saved = measure_gpt_saved_bytes(s, b, h, a, num_layers, vocab_size, mode, attention_impl)
        derived = num_layers * total(lab_terms(s, b, h, a, recompute=mode,
                                               attention_impl=attention_impl)) + outside
        flops = count_step_flops(s, b, h, a, mode, num_layers, attention_impl=attention_impl,
                                 vocab_size=vocab_size)["step"]
        lines.append(f"{mode:<11}{saved.bytes:>12}{derived:>12}{flops:>14}"
                     f"{hardware_flops_per_iteration(shape, b, mode):>14.0f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- FLOPs
def count_step_flops(s: int, b: int, h: int, a: int, recompute: str = "none", num_layers: int = 1,
                     sequence_parallel: bool = False, attention_impl: str = "explicit",
                     vocab_size: Optional[int] = None, seed: int = 0) -> Dict[str, int]:
    """FLOPs of one forward and of forward + backward on this rank, counted by
    ``FlopCounterMode``: a ``TransformerBlock`` of ``num_layers`` layers (input requiring grad,
    so backward computes the input's gradient too), or with ``vocab_size`` a ``GPTModel``."""
    t = _ready(seed)
    config = recompute_config(h, a, recompute, num_layers, sequence_parallel, attention_impl)
    device = initialize.get_device()
    with FlopCounterMode(display=False) as counter:
        if vocab_size is None:
            model = TransformerBlock(config, post_process=False).train()
            x = torch.randn(s // t if sequence_parallel else s, b, h, device=device,
                            requires_grad=True)
            out = model(x)
        else:
            model = GPTModel(config, vocab_size, s).train()
            ids = torch.randint(0, vocab_size, (b, s), device=device)
            out = model(ids, labels=ids)
        forward = counter.get_total_flops()
        out.sum().backward()
    return dict(forward=forward, step=counter.get_total_flops())


def step_flops_formula(s: int, b: int, h: int, a: int, recompute: str = "none", t: int = 1,
                       num_layers: int = 1, ffn: Optional[int] = None) -> Dict[str, int]:
    """Hand-worked FLOPs per rank of a block: a layer's forward ``2 s b h (3h + h + 2 ffn)/t``
    (QKV, projection, fc1, fc2) + ``4 b s^2 h/t`` (attention core); a step is 3 forwards plus
    the recomputed forward: the layer's (full) or the attention core's (selective)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    ffn = 4 * h if ffn is None else ffn
    linear = 2 * s * b * h * (4 * h + 2 * ffn) // t
    core = 4 * b * s * s * h // t
    forward = linear + core
    extra = {"none": 0, "selective": core, "full": forward}[recompute]
    return dict(forward=num_layers * forward, step=num_layers * (3 * forward + extra))


def flops_row(s: int, b: int, h: int, a: int, recompute: str, num_layers: int = 1,
              attention_impl: str = "explicit") -> Dict[str, object]:
    """Counted against the formula, for one block on this rank."""
    counted = count_step_flops(s, b, h, a, recompute, num_layers, attention_impl=attention_impl)
    t = parallel_state.get_tensor_model_parallel_world_size()
    formula = step_flops_formula(s, b, h, a, recompute, t, num_layers)
    return dict(tp=t, recompute=recompute, counted=counted["step"], formula=formula["step"],
                forward=counted["forward"], over_forward=counted["step"] / counted["forward"])


def format_flops(rows: List[Dict[str, object]], s: int, b: int, h: int, a: int,
                 num_layers: int = 1) -> str:
    """The table: FLOPs of one step on one rank per mode, counted and hand-worked."""
    t = rows[0]["tp"] if rows else 1
    forward = step_flops_formula(s, b, h, a, "none", t, num_layers)["forward"]
    lines = [f"FLOPs of one step on one rank, {num_layers} layer(s), s={s} b={b} h={h} a={a} "
             f"t={t}: forward (24sbh^2 + 4bs^2h)/t = {forward}",
             f"{'recompute':<11}{'counted':>14}{'formula':>14}{'/ forward':>11}"]
    for r in rows:
        lines.append(f"{r['recompute']:<11}{r['counted']:>14}{r['formula']:>14}"
                     f"{r['over_forward']:>11.3f}")
    return "\n".join(lines)
