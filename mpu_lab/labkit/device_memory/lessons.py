"""Lab 03's measurements, on one device (this process, a world of one rank): what a small GPT
keeps for training, counted from its tensors (:func:`count_model_state`,
:func:`count_bf16_layout`), what gradient accumulation changes (:func:`accumulation_rows`),
the three recompute modes timed (:func:`time_recompute_modes`), Megatron-core's ``recompute_*``
fields accepted and refused (:func:`recompute_field_rows`), and GPT-3 175B per layer
(:func:`format_gpt3`). The saved bytes and FLOPs per recompute mode are
:mod:`mpu_lab.perf.recompute`'s; the storage counting is
:func:`mpu_lab.training.resident_bytes.storage_bytes`'s.
"""
from __future__ import annotations

import dataclasses
import statistics
import textwrap
import time
from typing import Dict, List, Sequence

import torch

from mpu_lab.core import parallel_state
from mpu_lab.core.models.gpt import GPTModel
from mpu_lab.core.tensor_parallel import model_parallel_manual_seed
from mpu_lab.core.transformer import TransformerConfig
from mpu_lab.perf import recompute
from mpu_lab.perf.cost_model import ModelShape, bytes_per_parameter, hardware_flops_per_iteration
from mpu_lab.perf.cost_model.activations import activation_memory_per_layer
from mpu_lab.perf.saved_activations import SavedTensors
from mpu_lab.training import initialize
from mpu_lab.training.arguments import parse_args
from mpu_lab.training.flag_errors import FlagError
from mpu_lab.training.recompute_args import check_recompute_args
from mpu_lab.training.resident_bytes import storage_bytes

KINDS = ("params", "grads", "optimizer")


@dataclasses.dataclass(frozen=True)
class Shape:
    """The lab's small GPT: layers, hidden size, heads, sequence length, vocabulary."""

    layers: int
    hidden: int
    heads: int
    seq_length: int
    vocab_size: int

    def __post_init__(self):
        for name, value in dataclasses.asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads "
                             f"({self.heads})")


def build_gpt(shape: Shape, recompute_mode: str = "none", dropout: float = 0.0,
              seed: int = 0) -> GPTModel:
    """The small GPT on this process (a one-rank world, started when needed), fp32, training
    mode, with Megatron-core's fields for ``recompute_mode`` (:data:`mpu_lab.perf.recompute.MODES`),
    the same weights for the same ``seed``."""
    if not parallel_state.model_parallel_is_initialized():
        initialize.init_single_process()
    model_parallel_manual_seed(seed)
    config = recompute.recompute_config(shape.hidden, shape.heads, recompute_mode, shape.layers,
                                        dropout=dropout)
    return GPTModel(config, shape.vocab_size, shape.seq_length).train()


def tokens(shape: Shape, batch: int, seed: int = 0) -> torch.Tensor:
    """``[batch, s]`` token ids, the same on any machine for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab_size, (batch, shape.seq_length), generator=gen)  # cpu: CPU generator
    return ids.to(initialize.get_device())


def _counts(params, grads, states) -> Dict[str, int]:
    return dict(params=storage_bytes(params), grads=storage_bytes(grads),
                optimizer=storage_bytes(states))


def count_model_state(shape: Shape, batch: int = 2, seed: int = 0) -> Dict[str, int]:
    """One AdamW step of the small GPT in fp32 (mpu_lab's training), then the bytes of every
    storage behind the parameters, their gradients and the optimizer's state, and ``n`` (the
    parameters) and ``tensors`` (how many parameter tensors: AdamW keeps a 4-byte step
    counter per tensor)."""
    model = build_gpt(shape, seed=seed)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    ids = tokens(shape, batch, seed)
    model(ids, labels=ids).mean().backward()
    optimizer.step()
    states = [t for st in optimizer.state.values() for t in st.values()]
    out = _counts([p.data for p in params], [p.grad for p in params], states)
    return dict(out, n=sum(p.numel() for p in params), tensors=len(params))


def count_bf16_layout(shape: Shape, batch: int = 2, seed: int = 0) -> Dict[str, int]:
    """Megatron's bf16 training laid out with real tensors and counted the same way: the model's
    weights in bf16, one fp32 buffer of main gradients (Megatron's DDP grad buffer), and the
    optimizer's fp32 main copy of the weights with Adam's moments on it (one flat tensor: one
    step counter). The gradient is the fp32 model's, cast as Megatron's buffer receives it."""
    model = build_gpt(shape, seed=seed)
    params = list(model.parameters())
    ids = tokens(shape, batch, seed)
    model(ids, labels=ids).mean().backward()
    bf16_weights = [p.detach().to(torch.bfloat16) for p in params]
    main_grad = torch.cat([p.grad.reshape(-1) for p in params]).float()
    main_param = torch.cat([p.detach().reshape(-1) for p in params]).float().requires_grad_()
    main_param.grad = main_grad
    optimizer = torch.optim.Adam([main_param], lr=1e-3)
    optimizer.step()
    states = [main_param] + [t for st in optimizer.state.values() for t in st.values()]
    out = _counts(bf16_weights, [main_grad], states)
    return dict(out, n=main_param.numel(), tensors=1)


def format_model_state(fp32: Dict[str, int], bf16: Dict[str, int]) -> str:
    """Counted bytes and bytes per parameter, next to Megatron-core's table."""
    n = fp32["n"]
    lines = [f"{n:,} parameters in {fp32['tensors']} tensors; bytes counted from the tensors",
             f"{'training':<24}{'params':>10}{'grads':>10}{'optimizer':>11}{'total':>11}"
             f"{'per param':>11}{'table':>7}"]
    for name, c, dtype in (("fp32 + AdamW (mpu_lab)", fp32, "fp32"),
                           ("bf16, fp32 main grads", bf16, "bf16")):
        total = sum(c[k] for k in KINDS)
        lines.append(f"{name:<24}{c['params']:>10,}{c['grads']:>10,}{c['optimizer']:>11,}"
                     f"{total:>11,}{total / n:>11.3f}{bytes_per_parameter(dtype, 'fp32'):>7g}")
    extra = fp32["optimizer"] - 8 * n
    lines.append(f"the fp32 optimizer's bytes beyond 8 per parameter: {extra} = "
                 f"{fp32['tensors']} step counters x {extra // max(fp32['tensors'], 1)} bytes")
    return "\n".join(lines)


# --------------------------------------------------------------------------- accumulation
def _flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def accumulation_rows(shape: Shape, global_batch: int, micro_batches: Sequence[int] = (1, 2, 4),
                      seed: int = 0) -> List[Dict[str, float]]:
    """One optimizer step on the same ``global_batch`` samples, split into ``m`` micro-batches
    for each ``m``: the bytes autograd kept for each micro-batch's backward (the largest),
    the resident params / grads / optimizer bytes after the step, and how far the accumulated
    gradient is from the one-batch gradient (max abs difference over max abs value). Dropout
    off, so every split computes the same function."""
    for m in micro_batches:
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or global_batch % m:
            raise ValueError(f"each micro-batch count must divide global_batch={global_batch}, "
                             f"got {m!r}")
    ids = tokens(shape, global_batch, seed)
    rows, first = [], None
    for m in micro_batches:
        model = build_gpt(shape, seed=seed)
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        kept = []
        for chunk in ids.chunk(m):
            chunk = chunk.clone()              # a micro-batch of its own, as a loader gives it
            with SavedTensors(exclude=params) as saved:
                loss = model(chunk, labels=chunk).mean() / m
            kept.append(saved.bytes)
            loss.backward()
        grads = _flat_grads(model)
        first = grads if first is None else first
        error = float((grads - first).abs().max() / first.abs().max())
        optimizer.step()
        states = [t for st in optimizer.state.values() for t in st.values()]
        counts = _counts([p.data for p in params], [p.grad for p in params], states)
        rows.append(dict(m=m, micro_batch=global_batch // m, activations=max(kept),
                         grad_error=error, **counts))
    return rows


def format_accumulation(rows: List[Dict[str, float]], rtol: float = 1e-5) -> str:
    """The table, and the verdicts computed from it (``rtol`` for the gradients)."""
    base = rows[0]
    lines = [f"{'micro-batches':>13}{'of':>4}{'activations':>13}{'/ m=' + str(base['m']):>8}"
             f"{'params':>10}{'grads':>10}{'optimizer':>11}{'grad vs 1 batch':>17}"]
    for r in rows:
        lines.append(f"{r['m']:>13}{r['micro_batch']:>4}{r['activations']:>13,}"
                     f"{r['activations'] / base['activations']:>8.3f}{r['params']:>10,}"
                     f"{r['grads']:>10,}{r['optimizer']:>11,}"
                     f"{'< ' + format(rtol, 'g') if r['grad_error'] < rtol else 'DIFFERS':>17}")
    same = all(r[k] == base[k] for r in rows for k in KINDS)
    equal = all(r["grad_error"] < rtol for r in rows)
    lines.append(f"params, grads, optimizer the same for every split: {same}")
    lines.append(f"gradient equal to one batch's within {rtol:g} (relative): {equal}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- recompute modes
def recompute_rows(shape: Shape, batch: int) -> Dict[str, Dict[str, int]]:
    """Per recompute mode, for the small GPT with dropout 0.1: the bytes autograd kept
    (measured), the same derived from the terms (:func:`mpu_lab.perf.recompute.lab_terms`, L
    layers + what the GPT keeps outside them), the FLOPs of one forward and backward counted
    by ``FlopCounterMode`` and the cost model's count."""
    s, b, h, a, L, V = (shape.seq_length, batch, shape.hidden, shape.heads, shape.layers,
                        shape.vocab_size)
    model = ModelShape(num_layers=L, hidden_size=h, num_attention_heads=a, seq_length=s,
                       vocab_size=V)
    outside = recompute.total(recompute.gpt_outside_terms(s, b, h, V))
    rows = {}
    for mode in recompute.MODES:
        rows[mode] = dict(
            saved=recompute.measure_gpt_saved_bytes(s, b, h, a, L, V, mode).bytes,
            derived=L * recompute.total(recompute.lab_terms(s, b, h, a, recompute=mode)) + outside,
            outside=outside,
            flops=recompute.count_step_flops(s, b, h, a, mode, L, vocab_size=V)["step"],
            formula=round(hardware_flops_per_iteration(model, b, mode)))
    return rows


def format_recompute_rows(rows: Dict[str, Dict[str, int]]) -> str:
    """The table, with each mode's ratios to no recomputation."""
    base = rows["none"]
    lines = [f"{'recompute':<11}{'kept bytes':>12}{'derived':>12}{'x none':>8}{'FLOPs':>13}"
             f"{'cost model':>13}{'x none':>8}"]
    for mode, r in rows.items():
        lines.append(f"{mode:<11}{r['saved']:>12,}{r['derived']:>12,}"
                     f"{r['saved'] / base['saved']:>8.3f}{r['flops']:>13,}{r['formula']:>13,}"
                     f"{r['flops'] / base['flops']:>8.3f}")
    full = rows["full"]
    lines.append(f"full keeps {full['derived'] - full['outside']:,} bytes in its layers (their "
                 f"inputs) and {full['outside']:,} outside them,")
    lines.append("which no mode recomputes (embedding, final LayerNorm, output layer, loss)")
    return "\n".join(lines)


def time_recompute_modes(shape: Shape, batch: int, repeats: int = 5,
                         seed: int = 0) -> Dict[str, List[float]]:
    """Seconds of one forward + backward of the small GPT (dropout 0.1) per recompute mode,
    ``repeats`` times each after one warm-up, the modes interleaved so that the machine's
    load falls on all of them alike."""
    models = {mode: build_gpt(shape, mode, recompute.DROPOUT, seed) for mode in recompute.MODES}
    ids = tokens(shape, batch, seed)
    times: Dict[str, List[float]] = {mode: [] for mode in models}
    for i in range(repeats + 1):
        for mode, model in models.items():
            start = time.perf_counter()
            model(ids, labels=ids).mean().backward()
            if i:
                times[mode].append(time.perf_counter() - start)
    return times


def format_step_times(times: Dict[str, List[float]], flops: Dict[str, int]) -> str:
    """Median step time per mode and its ratio to no recomputation, next to the FLOPs ratio,
    and the spread of the repeats (max / min - 1): a time ratio is only read against it."""
    base_t = statistics.median(times["none"])
    lines = [f"{'recompute':<11}{'median ms':>10}{'x none':>8}{'FLOPs x none':>14}"
             f"{'spread':>9}"]
    spreads = {}
    for mode, ts in times.items():
        spreads[mode] = max(ts) / min(ts) - 1
        lines.append(f"{mode:<11}{1e3 * statistics.median(ts):>10.1f}"
                     f"{statistics.median(ts) / base_t:>8.2f}"
                     f"{flops[mode] / flops['none']:>14.2f}{spreads[mode]:>9.0%}")
    full_t = statistics.median(times["full"]) / base_t
    full_f = flops["full"] / flops["none"]
    off = abs(full_t - full_f) / full_f
    spread = max(spreads.values())
    lines.append(f"full: time x{full_t:.2f} vs FLOPs x{full_f:.2f} ({off:.0%} apart); "
                 f"the repeats of one mode spread up to {spread:.0%}")
    lines.append("so the gap is " + ("within the spread: these times cannot price recomputation"
                                     if off <= spread else
                                     "beyond the spread: the time prices more than the FLOPs"))
    return "\n".join(lines)


# --------------------------------------------------------------------------- Megatron's fields
FIELD_CASES = (
    dict(),
    dict(recompute_granularity="selective"),
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    dict(recompute_granularity="full"),
    dict(recompute_granularity="full", recompute_method="uniform"),
    dict(recompute_granularity="selective", recompute_num_layers=1),
    dict(recompute_granularity="selective", distribute_saved_activations=True),
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
         distribute_saved_activations=True, sequence_parallel=True),
)


def recompute_field_rows(num_layers: int = 4) -> List[Dict[str, str]]:
    """Each of :data:`FIELD_CASES` given to ``TransformerConfig`` (Megatron-core's checks):
    accepted, or its message; where the config accepts it, the same fields as
    ``train_gpt.py``'s flags at TP = 2 (Megatron-LM's ``validate_args`` adds a rule:
    ``distribute_saved_activations`` only with full recomputation)."""
    rows = []
    for fields in FIELD_CASES:
        shown = ", ".join(f"{k.replace('recompute_', '')}={v!r}" for k, v in fields.items())
        try:
            TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                              **fields)
        except ValueError as exc:
            rows.append(dict(fields=shown, verdict=f"refused: {exc}"))
            continue
        verdict = "accepted"
        flags = parse_args(["--tensor-model-parallel-size", "2"])   # train_gpt.py's defaults
        vars(flags).update(fields)
        try:
            check_recompute_args(flags)
        except FlagError as exc:
            verdict += f"; train_gpt.py refuses its flags (as Megatron-LM does): {exc}"
        rows.append(dict(fields=shown or "(none: no recomputation)", verdict=verdict))
    return rows


def format_field_rows(rows: List[Dict[str, str]], width: int = 96) -> str:
    """The rows, each verdict wrapped under its fields (lines of at most ``width``)."""
    lines = []
    for r in rows:
        lines += textwrap.wrap(r["fields"], width, subsequent_indent="  ")
        lines += textwrap.wrap(r["verdict"], width, initial_indent="    ",
                               subsequent_indent="      ", break_on_hyphens=False)
    return "\n".join(lines)


# --------------------------------------------------------------------------- GPT-3 175B
def format_gpt3(s: int = 2048, b: int = 1, h: int = 12288, a: int = 96, t: int = 8,
                layers: int = 96) -> str:
    """Korthikanti et al.'s Table 2 for GPT-3 175B at TP = ``t``: MB per layer per GPU, and GB
    for all ``layers`` (bf16, the paper's constants)."""
    lines = [f"GPT-3 175B, s={s} b={b} h={h} a={a}, TP={t}; paper's 16-bit constants",
             f"{'recompute':<11}{'TP MB/layer':>13}{'TP+SP MB/layer':>16}"
             f"{'TP+SP GB, ' + str(layers) + ' layers':>22}"]
    for mode in recompute.MODES:
        tp = activation_memory_per_layer(s, b, h, a, t, False, mode)
        sp = activation_memory_per_layer(s, b, h, a, t, True, mode)
        lines.append(f"{mode:<11}{tp / 1e6:>13.1f}{sp / 1e6:>16.1f}{layers * sp / 1e9:>22.2f}")
    mb = {(mode, sp): activation_memory_per_layer(s, b, h, a, t, sp, mode)
          for mode in ("none", "selective") for sp in (False, True)}
    lines.append(f"selective alone (both with SP): {mb['none', True] / mb['selective', True]:.2f}x "
                 f"less per layer")
    lines.append(f"SP and selective together, against TP alone without recomputation: "
                 f"{mb['none', False] / mb['selective', True]:.2f}x less")
    return "\n".join(lines)
