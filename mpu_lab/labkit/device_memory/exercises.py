"""Lab 03's checks: bytes per parameter (:func:`check_bytes_per_parameter`, Megatron-core's
table), what gradient accumulation changes (:func:`check_accumulation_factors`), GPT-3 175B's
activations per layer (:func:`check_gpt3_activation_mb`, Korthikanti et al. 2022), and the
write-the-code exercise :data:`CHECKPOINT`: activation recomputation with the RNG save and
restore, run on a live world at TP = 2 with dropout on and compared with no recomputation.
"""
from __future__ import annotations

import contextlib
import io
import textwrap
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from mpu_lab.core import parallel_state
from mpu_lab.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                         get_rng_tracker, model_parallel_manual_seed)
from mpu_lab.labkit.column_parallel.build import tp_pairs, two_tp_ranks
from mpu_lab.labkit.grader import Case, Exercise, Outcome, compare, grade
from mpu_lab.labkit.notebooks.leaks import declare_answers
from mpu_lab.labkit.verdict import Verdict, as_floats, unanswered, verdict
from mpu_lab.perf.cost_model import bytes_per_parameter, bytes_per_parameter_terms
from mpu_lab.perf.cost_model.activations import activation_memory_per_layer
from mpu_lab.perf.saved_activations import SavedTensors
from mpu_lab.training import initialize

# GPT-3 175B (Brown et al. 2020; Korthikanti et al. 2022, Table 3): s, b, h, a, and TP = 8
GPT3 = dict(s=2048, b=1, h=12288, a=96, t=8)
RECOMPUTE_MODES = ("none", "selective", "full")


# --------------------------------------------------------------------------- predictions
def check_bytes_per_parameter(answer: Any) -> Verdict:
    """``answer = (fp32 training, bf16 weights with fp32 gradients)``: the bytes Adam training
    keeps per parameter (weight, gradient, optimizer states), Megatron-core's table
    (:func:`mpu_lab.perf.cost_model.bytes_per_parameter`)."""
    if unanswered(answer, "a pair (fp32 bytes, bf16 bytes) per parameter"):
        return Verdict(False)
    got = as_floats(answer)
    expected = [bytes_per_parameter("fp32", "fp32"), bytes_per_parameter("bf16", "fp32")]
    parts = []
    for dtype in ("fp32", "bf16"):
        terms = bytes_per_parameter_terms(dtype, "fp32")
        flat = {**terms["replicated"], **terms["sharded"]}
        parts.append(f"{dtype}: " + " + ".join(f"{v} {k}" for k, v in flat.items())
                     + f" = {sum(flat.values())}")
    return verdict(got is not None and len(got) == 2 and got == expected,
                   f"({expected[0]:g}, {expected[1]:g}). " + "; ".join(parts) + ".",
                   f"{answer!r} is not it. Hint: count the weight, its gradient, Adam's two "
                   f"moments, and (bf16 only) the fp32 main copy of the weight that the "
                   f"optimizer updates.")


# what changes when one batch is split into m micro-batches: the factor of each
ACCUMULATION_KEYS = ("params", "grads", "optimizer", "activations")


def accumulation_factors(m: int) -> Dict[str, float]:
    """Gradient accumulation over ``m`` micro-batches of the same global batch: the factor on
    each kind of memory (the activations are kept for one micro-batch at a time)."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"m (micro-batches) must be a whole number >= 1, got {m!r}")
    return dict(params=1.0, grads=1.0, optimizer=1.0, activations=1.0 / m)


def check_accumulation_factors(answer: Any, m: int, rtol: float = 0.02) -> Verdict:
    """``answer``: a dict with the factor on each of :data:`ACCUMULATION_KEYS` when one batch is
    split into ``m`` micro-batches (1 = unchanged)."""
    if unanswered(answer, "a dict of four factors"):
        return Verdict(False)
    expected = accumulation_factors(m)
    if not isinstance(answer, dict) or set(answer) != set(ACCUMULATION_KEYS):
        keys = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
        print(f"Not yet: give a dict with the keys {list(ACCUMULATION_KEYS)}, got {keys}.")
        return Verdict(False)
    wrong = []
    for key in ACCUMULATION_KEYS:
        got = as_floats(answer[key])
        if got is None or len(got) != 1 or abs(got[0] - expected[key]) > rtol * expected[key]:
            wrong.append(key)
    shown = ", ".join(f"{k} x{expected[k]:g}" for k in ACCUMULATION_KEYS)
    return verdict(not wrong, f"{shown}: only the activations of one micro-batch are alive at "
                              f"a time; the weights, gradients and optimizer states are the "
                              f"model's, whatever the batch.",
                   f"{', '.join(wrong)} not right. Hint: which of them has a batch dimension?")


def gpt3_activation_mb(s: int = GPT3["s"], b: int = GPT3["b"], h: int = GPT3["h"],
                       a: int = GPT3["a"], t: int = GPT3["t"]) -> Dict[str, float]:
    """MB (1e6 bytes) of activations one layer keeps per GPU with TP = ``t`` and sequence
    parallelism, per recompute mode, with the paper's 16-bit constants
    (:func:`mpu_lab.perf.cost_model.activations.activation_memory_per_layer`)."""
    return {mode: activation_memory_per_layer(s, b, h, a, t, True, mode) / 1e6
            for mode in RECOMPUTE_MODES}


def check_gpt3_activation_mb(answer: Any, rtol: float = 0.02) -> Verdict:
    """``answer = (none, selective, full)``: MB per layer per GPU of GPT-3 175B at TP = 8 with
    sequence parallelism (:func:`gpt3_activation_mb`), within ``rtol``."""
    if unanswered(answer, "three numbers of MB (none, selective, full)"):
        return Verdict(False)
    got = as_floats(answer)
    expected = gpt3_activation_mb()
    ok = got is not None and len(got) == 3 and all(
        abs(g - e) <= rtol * e for g, e in zip(got, expected.values()))
    s, b, h, a, t = (GPT3[k] for k in "sbhat")
    return verdict(ok, f"none {expected['none']:.1f}, selective {expected['selective']:.1f}, "
                       f"full {expected['full']:.1f} MB: sbh/t = {s * b * h // t:,} values, "
                       f"x (34 + 5as/h = {34 + 5 * a * s // h}), x 34, x 2 bytes.",
                   f"{answer!r} is not it (within {rtol:.0%}). Hint: with SP every term is "
                   f"divided by t; what does 5as/h come to for a = {a}, s = {s}, h = {h}?")


# --------------------------------------------------------------------------- write the code
# The learner writes ``my_checkpoint(function, distribute_saved_activations, *args)``,
# Megatron's ``checkpoint`` (saved under that name into my_megatron/random.py):
# ``function(*args)`` whose activations are not kept, recomputed in backward with the same
# random numbers. Graded on every rank of a TP = 2 world with a small tensor-parallel
# MLP whose two dropouts draw from the two streams Megatron uses (the tracker's, inside the
# tensor-parallel region; the default generator's, after the all-reduce), against the same MLP
# without recomputation.
TRACKER_MASK = "the tracker-stream dropout (inside the tensor-parallel region)"
DEFAULT_MASK = "the default-generator dropout (after the all-reduce)"


class DropoutMLP(torch.nn.Module):
    """Column-parallel linear, dropout drawn in ``get_rng_tracker().fork()``, GeLU,
    row-parallel linear (all-reduce), dropout from the default generator. Each call records its
    two masks in ``calls`` (the probe sees what each run drew; the mirror is untouched)."""

    def __init__(self, h: int, ffn: int, p: float):
        super().__init__()
        self.fc1 = ColumnParallelLinear(h, ffn, gather_output=False)
        self.fc2 = RowParallelLinear(ffn, h, input_is_parallel=True)
        self.p = p
        self.calls: List[Dict[str, torch.Tensor]] = []

    def _dropout(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        keep = torch.empty_like(x).bernoulli_(1 - self.p)   # from the current default generator
        return x * keep / (1 - self.p), keep.bool()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.fc1(x)                                   # [s, b, ffn/t]
        with get_rng_tracker().fork():
            y, tracker_keep = self._dropout(y)
        z, _ = self.fc2(torch.nn.functional.gelu(y))         # [s, b, h], all-reduced
        z, default_keep = self._dropout(z)
        self.calls.append({TRACKER_MASK: tracker_keep, DEFAULT_MASK: default_keep})
        return z


def _rng_now() -> Tuple[torch.Tensor, Dict[str, Any]]:
    return torch.get_rng_state(), get_rng_tracker().get_states()


def _same_rng(a, b) -> bool:
    (cpu_a, tracker_a), (cpu_b, tracker_b) = a, b
    if not torch.equal(cpu_a, cpu_b) or set(tracker_a) != set(tracker_b):
        return False
    for name in tracker_a:
        for x, y in zip(tracker_a[name], tracker_b[name]):
            if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
                return False
    return True


def _build(case: Case) -> Tuple[List[DropoutMLP], torch.Tensor]:
    """The case's layers (weights from the default generator) and input (the same on every
    rank of the tensor-parallel group), after seeding both streams with the case's seed."""
    p = case.params
    model_parallel_manual_seed(p["seed"])
    device = initialize.get_device()
    layers = [DropoutMLP(p["h"], p["ffn"], p["dropout"]).to(device) for _ in range(p["layers"])]
    gen = torch.Generator().manual_seed(p["seed"] + 1)
    x = torch.randn(p["s"], p["b"], p["h"], generator=gen)   # cpu: CPU generator, moved below
    return layers, x.to(device).requires_grad_()


def _run(layers: Sequence[DropoutMLP], x: torch.Tensor, wrap: Optional[Callable]):
    out = x
    for layer in layers:
        out = layer(out) if wrap is None else wrap(layer, False, out)
    return out


def _weights(out: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(out.shape, generator=gen).to(out.device)   # cpu: CPU generator


def run_checkpoint_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank: the layers without recomputation (the reference), then through the
    learner's ``checkpoint``; compares what it kept, how often each layer ran, the masks the
    recomputation drew, the output, the gradients and the random state after backward."""
    where = (f"tensor-parallel rank {parallel_state.get_tensor_model_parallel_rank()} of "
             f"{parallel_state.get_tensor_model_parallel_world_size()}:")
    ref_layers, x_ref = _build(case)
    out_ref = _run(ref_layers, x_ref, None)
    (out_ref * _weights(out_ref)).sum().backward()
    rng_ref = _rng_now()

    layers, x = _build(case)
    params = [q for layer in layers for q in layer.parameters()]
    with SavedTensors(exclude=params) as saved:
        out = _run(layers, x, learner)
    seen = compare(f"{where} the output of my_checkpoint(layer, False, x)", out_ref, out)
    if not seen.ok:
        return seen
    kept = x.numel() * x.element_size() * len(layers)
    if saved.bytes > kept:
        return Outcome(False, f"{where} the bytes autograd kept for backward",
                       f"at most the layers' inputs, {kept} bytes",
                       f"{saved.bytes} bytes: the layer's activations were kept, so nothing "
                       f"needs recomputing (run function under torch.no_grad())")
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        return Outcome(False, f"{where} the output", "a tensor that requires grad",
                       f"{type(out).__name__}, requires_grad="
                       f"{getattr(out, 'requires_grad', None)}")
    (out * _weights(out)).sum().backward()
    for i, layer in enumerate(layers):
        if len(layer.calls) != 2:
            return Outcome(False, f"{where} how many times layer {i} ran",
                           "twice: the forward (no activations kept) and the recomputation in "
                           "backward", f"{len(layer.calls)} time(s)")
        for name in (TRACKER_MASK, DEFAULT_MASK):
            first, again = layer.calls[0][name], layer.calls[1][name]
            if not torch.equal(first, again):
                differ = int((first != again).sum())
                return Outcome(False, f"{where} layer {i}: {name}'s mask",
                               "the forward's mask, drawn again in the recomputation",
                               f"a different mask ({differ} of {first.numel()} elements "
                               f"differ): restore the random state it was drawn from")
    seen = compare(f"{where} x.grad", x_ref.grad, x.grad)
    names = [n for layer in layers for n, _ in layer.named_parameters()]
    refs = [q for layer in ref_layers for q in layer.parameters()]
    for i, (name, q_ref, q) in enumerate(zip(names, refs, params)):
        if not seen.ok:
            return seen
        seen = compare(f"{where} the gradient of {name} (layer {i // 4})", q_ref.grad, q.grad)
    if not seen.ok:
        return seen
    if not _same_rng(rng_ref, _rng_now()):
        return Outcome(False, f"{where} the random states after backward",
                       "those found before the recomputation (the next dropout draws on)",
                       "different ones: put back the states backward started with")
    return Outcome(True)


CHECKPOINT = Exercise(
    name="my_checkpoint",
    run_case=run_checkpoint_case,
    cases=[
        Case("one layer, dropout 0.5, s=4 b=2 h=8", dict(layers=1, s=4, b=2, h=8, ffn=16,
                                                         dropout=0.5, seed=1)),
        Case("two layers in a row, dropout 0.1", dict(layers=2, s=6, b=1, h=8, ffn=32,
                                                      dropout=0.1, seed=2)),
        Case("one layer, dropout 0.3, s=5 b=3 h=4", dict(layers=1, s=5, b=3, h=4, ffn=8,
                                                         dropout=0.3, seed=3)),
    ],
    hint="forward: remember the random states (torch.get_rng_state(), the GPU's when device "
         "is CUDA, and tensor_parallel.get_rng_tracker().get_states()), run the function "
         "under torch.no_grad() and save only its inputs. backward: note the states now, put "
         "the remembered ones back, rerun the function with grad on detached inputs, "
         "backpropagate, then put the noted states back.",
    ranks_needed=two_tp_ranks,
    layout=tp_pairs,
    module="random.py",
    saves_as=("checkpoint",))


def grade_wrapped(learner: Callable, world, width: int = 100) -> Verdict:
    """:func:`mpu_lab.labkit.grader.grade` on :data:`CHECKPOINT`, its verdict printed in lines
    of at most ``width`` characters (to show a verdict in a stored output)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = grade(learner, CHECKPOINT, world)
    for line in out.getvalue().splitlines():
        print(textwrap.fill(line, width, subsequent_indent="  ") if line else line)
    return result


# --------------------------------------------------------------------------- answers in sight
_GPT3 = gpt3_activation_mb()
declare_answers([
    ("03", "bytes per parameter", [(16, 18), "16 and 18"], "check_bytes_per_parameter("),
    ("03", "GPT-3 per layer", [f"{_GPT3['none']:.1f}", f"{_GPT3['selective']:.1f}"],
     "check_gpt3_activation_mb("),
])
