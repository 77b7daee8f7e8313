"""Activation memory of one transformer layer, measured: what autograd keeps for backward, against
the terms of Korthikanti et al. 2022.

The paper's terms (§4.1; tensor parallelism §4.2.1, sequence parallelism §4.2.2) and their sum,
``sbh (34 + 5as/h)`` and its Table 2 family, are in :mod:`mpu_lab.perf.cost_model.activations`
(re-exported here). :func:`measure_layer_activation_bytes` counts what autograd really saves for
one ``TransformerLayer`` forward (``torch.autograd.graph.saved_tensors_hooks``; every
storage counted once, parameters left out). :func:`mpu_lab_terms` is the list of terms that
matches this package's layer byte for byte:

* fp32 activations: 4 bytes per value, not 2;
* dropout 0: no masks, and the softmax output is what ``Score_i V_i`` keeps (no separate
  dropout output);
* LayerNorm also keeps its mean and 1/std (``[s, b]`` each, fp32), which the paper neglects;
* the explicit softmax keeps the ``s x s`` causal mask (bool);
  ``attention_impl="sdpa"`` (on CPU a flash-attention kernel) keeps no ``s x s`` tensor at all,
  only a log-sum-exp per row (``a s b / t`` fp32): the ``5as/h`` term is gone, as with the
  paper's selective recomputation (§5), because the kernel recomputes the scores in backward;
* with sequence parallelism, ``ColumnParallelLinear`` keeps only this rank's ``[s/t, b, h]``
  block of its input and all-gathers it again in backward, as Megatron's
  ``LinearWithGradAccumulationAndAsyncCommunication`` does
  (:mod:`mpu_lab.core.tensor_parallel.linear_autograd`): the paper's ``/t`` (§4.2.2).

:func:`compare`, :func:`format_comparison` and :func:`format_terms` make lab 09's tables
(``launch/activation_memory.py`` runs the measurement at TP > 1). With dropout on and under
Megatron's recomputation modes (none / selective / full), the same counting is done by
:mod:`mpu_lab.perf.recompute`.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state
from mpu_lab.core.transformer.transformer_layer import TransformerLayer, TransformerConfig
from mpu_lab.perf.cost_model.activations import (  # noqa: F401  (the terms, one home)
    BOOKKEEPING, CATEGORIES, MASKS, REPLICATED, SCORES, SPLIT, Term,
    activation_memory_per_layer, layer_activation_terms, paper_terms, total)


def mpu_lab_terms(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                  attention: str = "explicit", activation: str = "gelu",
                  dtype: torch.dtype = torch.float32) -> List[Term]:
    """The terms of this package's ``TransformerLayer`` with dropout 0 (the labs'
    setting): what :func:`measure_layer_activation_bytes` finds, byte for byte."""
    return layer_activation_terms(
        s, b, h, a, t, sequence_parallel, bytes_per_value=torch.finfo(dtype).bits // 8,
        dropout=False, attention=attention, activation=activation, layernorm_stats=True,
        causal_mask=True, saves_gathered_input=False)


# --------------------------------------------------------------------------- measuring
class SavedTensors:
    """``with SavedTensors(exclude=model.parameters()) as saved:`` counts the tensors autograd
    saves for backward inside the block. A tensor is counted by its storage, once, however
    many ops save it or views of it; storages in ``exclude`` (the weights) are not counted."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {p.untyped_storage().data_ptr() for p in exclude}
        self.storages: Dict[int, Tuple[int, tuple, torch.dtype]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._excluded and key not in self.storages:
            self.storages[key] = (storage.nbytes(), tuple(tensor.shape), tensor.dtype)
        return tensor     # keep it: every counted storage stays alive until backward

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __enter__(self) -> "SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False

    @property
    def bytes(self) -> int:
        return sum(n for n, _, _ in self.storages.values())

    def listing(self) -> List[Tuple[int, tuple, str]]:
        """``(bytes, shape, dtype)`` per storage, largest first."""
        return sorted(((n, shape, str(dtype).replace("torch.", ""))
                       for n, shape, dtype in self.storages.values()), key=lambda x: -x[0])


def measure_layer_activation_bytes(s: int, b: int, h: int, a: int,
                                   sequence_parallel: bool = False,
                                   attention_impl: str = "explicit", activation: str = "gelu",
                                   seed: int = 0) -> SavedTensors:
    """Run one ``TransformerLayer`` forward on this rank (input ``[s, b, h]``, or the
    rank's ``[s/t, b, h]`` with sequence parallelism, requiring grad) and return what autograd
    saved for its backward. The tensor-parallel size is the current group's (at TP=1 this
    runs in the calling process: :func:`mpu_lab.training.initialize.init_single_process`)."""
    if not parallel_state.model_parallel_is_initialized():
        initialize.init_single_process()
    t = parallel_state.get_tensor_model_parallel_world_size()
    config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=a,
                               activation=activation, sequence_parallel=sequence_parallel,
                               attention_impl=attention_impl)
    config.check(t, s)
    device = initialize.get_device()
    torch.manual_seed(seed)
    layer = TransformerLayer(config)
    rows = s // t if sequence_parallel else s
    x = torch.randn(rows, b, h, device=device, requires_grad=True)   # [s(/t), b, h]
    with SavedTensors(exclude=layer.parameters()) as saved:
        layer(x)
    return saved


def compare(s: int, b: int, h: int, a: int, t: int, sequence_parallel: bool, measured: int,
            attention: str = "explicit", activation: str = "gelu") -> Dict[str, object]:
    """One row of the lab's table: measured bytes, this package's terms, the paper's."""
    model = mpu_lab_terms(s, b, h, a, t, sequence_parallel, attention, activation)
    return dict(tp=t, sequence_parallel=sequence_parallel, attention=attention,
                measured=int(measured), model=total(model), model_terms=model,
                paper=activation_memory_per_layer(s, b, h, a, t, sequence_parallel),
                paper_terms=paper_terms(s, b, h, a, t, sequence_parallel))


def config_name(row: Dict[str, object]) -> str:
    name = f"TP={row['tp']}" + ("+SP" if row["sequence_parallel"] else "")
    return name + (" sdpa" if row.get("attention") == "sdpa" else "")


def format_comparison(rows: List[Dict[str, object]], s: int, b: int, h: int, a: int) -> str:
    """The lab's table: bytes per layer on one rank, and each in units of ``s b h``."""
    sbh = s * b * h
    lines = [f"one layer, s={s} b={b} h={h} a={a} (5as/h = {5 * a * s / h:g}); bytes on one rank",
             f"{'config':<16}{'measured':>10}{'mpu_lab terms':>15}{'paper (16-bit)':>16}"
             f"{'measured/sbh':>14}{'paper/sbh':>11}"]
    for r in rows:
        lines.append(f"{config_name(r):<16}{r['measured']:>10}{r['model']:>15}"
                     f"{round(r['paper']):>16}{r['measured'] / sbh:>14.2f}{r['paper'] / sbh:>11.2f}")
    return "\n".join(lines)


def format_terms(row: Dict[str, object], s: int, b: int, h: int) -> str:
    """The paper's terms next to this package's, in units of ``s b h`` bytes."""
    sbh = s * b * h
    paper = {n: v for n, _, v in row["paper_terms"]}
    ours = {n: v for n, _, v in row["model_terms"]}
    names = list(paper) + [n for n in ours if n not in paper]
    lines = [f"{config_name(row)}: terms in units of s*b*h bytes",
             f"{'term':<32}{'paper':>8}{'mpu_lab':>9}"]
    for n in names:
        p = f"{paper[n] / sbh:.2f}" if n in paper else "-"
        o = f"{ours[n] / sbh:.2f}" if n in ours else "-"
        lines.append(f"{n:<32}{p:>8}{o:>9}")
    lines.append(f"{'total':<32}{total(row['paper_terms']) / sbh:>8.2f}"
                 f"{total(row['model_terms']) / sbh:>9.2f}")
    return "\n".join(lines)


def ratios(rows: List[Dict[str, object]], key: str = "measured") -> Dict[str, float]:
    """Each configuration's bytes over the first row's (TP=1)."""
    base = rows[0][key]
    return {config_name(r): r[key] / base for r in rows}


def measured_row(s: int, b: int, h: int, a: int, sequence_parallel: bool = False,
                 attention_impl: str = "explicit", activation: str = "gelu",
                 saved: Optional[SavedTensors] = None) -> Dict[str, object]:
    """Measure on this rank and compare: :func:`measure_layer_activation_bytes` + :func:`compare`."""
    saved = saved or measure_layer_activation_bytes(s, b, h, a, sequence_parallel,
                                                    attention_impl, activation)
    row = compare(s, b, h, a, parallel_state.get_tensor_model_parallel_world_size(),
                  sequence_parallel, saved.bytes, attention_impl, activation)
    row["saved"] = saved.listing()
    return row
