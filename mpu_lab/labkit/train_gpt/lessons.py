"""Lab 14's printed lessons around its training runs, worked in the notebook's own process:

* :func:`loss_floor`, :func:`print_loss_bounds` — the loss of a model that guesses uniformly
  (``ln V``) and the lowest loss a model can reach on the synthetic walk (the entropy of the
  successor choice, averaged over the positions of a sample);
* :func:`precision_bytes`, :func:`print_precision_bytes` — what ``--fp16`` keeps per parameter:
  Megatron-core's table (its distributed-optimizer guide: fp16 parameters and gradients with
  fp32 main copies of both in the optimizer, :func:`mpu_lab.perf.cost_model.bytes_per_parameter`)
  against mpu_lab's ``torch.autocast`` over fp32 parameters, measured on a live AdamW and tied to
  :func:`mpu_lab.perf.memory_breakdown.mpu_lab_bytes_per_parameter`;
* :func:`print_padding_table`, :func:`padding_demo_tp`, :func:`repad_effect`,
  :func:`print_repad_effect`, :func:`print_resume_check` — what a checkpoint loaded with
  another vocabulary padding gets (:mod:`mpu_lab.training.checkpointing.vocab_padding`): the rows kept,
  trimmed or zero-filled, and the logits and loss before and after, from the dense twin
  (:class:`~mpu_lab.training.plain_gpt.PlainGPT`) holding the consolidated weights.
"""
from __future__ import annotations

import argparse
import math
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from mpu_lab.training import checkpointing, datasets
from mpu_lab import training
from mpu_lab.training.checkpointing import vocab_padding
from mpu_lab.labkit.train_gpt.runs import TrainRun, fit, print_agreement
from mpu_lab.training.plain_gpt import PlainGPT
from mpu_lab.core.models.gpt import pad_vocab_size
from mpu_lab.core.optimizer import build_optimizer
from mpu_lab.perf.cost_model import (
    bytes_per_parameter, bytes_per_parameter_terms, format_bytes_per_parameter)
from mpu_lab.perf.memory_breakdown import mpu_lab_bytes_per_parameter


# --------------------------------------------------------------------------- loss bounds
def loss_floor(vocab_size: int, seq_length: int, seed: int = 1234) -> float:
    """The expected loss of a model that knows the walk's graph: at each position the entropy
    of the successor choice of the current token (duplicate successors merged), the current
    token's distribution propagated from a uniform first token."""
    data = datasets.MockGPTDataset(1, seq_length, vocab_size, seed)
    probs = np.diff(np.concatenate([[0.0], data.cum_probs]))
    step = np.zeros((vocab_size, vocab_size))
    for v in range(vocab_size):
        np.add.at(step[v], data.successors[v], probs)
    rows = np.where(step > 0, step, 1.0)
    entropy = -(step * np.log(rows)).sum(axis=1)                 # per current token
    p, total = np.full(vocab_size, 1.0 / vocab_size), 0.0
    for _ in range(seq_length):
        total += float(p @ entropy)
        p = p @ step
    return total / seq_length


def print_loss_bounds(vocab_size: int, seq_length: int,
                      padded_vocab_size: Optional[int] = None) -> None:
    """The two bounds of a run's loss: a uniform guess over the softmax's ids (the padded
    vocabulary) and :func:`loss_floor`."""
    rows = padded_vocab_size or vocab_size
    print(f"a uniform guess over the {rows} ids of the (padded) vocabulary: ln {rows} = "
          f"{math.log(rows):.3f}")
    print(f"a model that has learned the graph: {loss_floor(vocab_size, seq_length):.3f} (the "
          f"entropy of the successor choice, averaged over the {seq_length} positions)")


# --------------------------------------------------------------------------- --fp16
def precision_bytes() -> Dict[str, Dict[str, int]]:
    """Bytes per parameter of Adam with ``--fp16``. ``megatron``: Megatron-core's terms for fp16
    parameters and gradients (:func:`~mpu_lab.perf.cost_model.bytes_per_parameter_terms`: the
    fp16 weight and gradient, the optimizer's fp32 main copies of both, Adam's two moments).
    ``mpu_lab``: measured on a parameter after one AdamW step
    (:func:`mpu_lab.core.optimizer.build_optimizer`) whose forward ran under
    ``torch.autocast(float16)``, as ``--fp16`` does; its total is
    :func:`~mpu_lab.perf.memory_breakdown.mpu_lab_bytes_per_parameter` (checked here)."""
    terms = bytes_per_parameter_terms("fp16", "fp16")
    megatron = {f"fp16 {k}": v for k, v in terms["replicated"].items()}
    megatron.update(terms["sharded"])
    layer = torch.nn.Linear(8, 8, bias=False)
    args = argparse.Namespace(weight_decay=0.01, lr=1e-3, adam_beta1=0.9, adam_beta2=0.95,
                              adam_eps=1e-8)
    optimizer = build_optimizer(layer, args)
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        layer(torch.randn(2, 8, device="cpu")).float().sum().backward()  # cpu: CPU autocast
    optimizer.step()
    p = layer.weight
    state = optimizer.state[p]
    ours = {f"{str(p.dtype)[6:]} param": p.element_size(),
            f"{str(p.grad.dtype)[6:]} grad": p.grad.element_size(),
            "Adam m": state["exp_avg"].element_size(),
            "Adam v": state["exp_avg_sq"].element_size()}
    if sum(ours.values()) != mpu_lab_bytes_per_parameter():
        raise RuntimeError(f"measured {ours} but mpu_lab.perf.memory_breakdown counts "
                           f"{mpu_lab_bytes_per_parameter():g} bytes per parameter")
    return {"megatron": megatron, "mpu_lab": ours}


def print_precision_bytes(data_parallel_size: int = 8) -> None:
    """Megatron-core's table of bytes per parameter (every dtype pair, with and without the
    distributed optimizer, the latter at ``data_parallel_size``), what ``--fp16`` costs there,
    and mpu_lab's measured figure."""
    print("Megatron-core's bytes per parameter (its distributed-optimizer guide; d = "
          "data-parallel size;\nP, G: the fp32 main param and grad; m, v: Adam's moments):")
    print(format_bytes_per_parameter(data_parallel_size, short=_SHORT_TERMS))
    parts = precision_bytes()
    for who, total in (("megatron --fp16", bytes_per_parameter("fp16", "fp16")),
                       ("mpu_lab --fp16", mpu_lab_bytes_per_parameter())):
        terms = parts[who.split()[0]]
        print(f"{who:>15}: " + " + ".join(f"{n} {_SHORT_TERMS.get(k, k)}" for k, n in terms.items())
              + f" = {total:g} bytes per parameter")


# the optimizer's terms in one letter each, so the table fits 100 characters
_SHORT_TERMS = {"fp32 main param": "P", "fp32 main grad": "G", "Adam m": "m", "Adam v": "v"}


# --------------------------------------------------------------------------- padding
def print_padding_table(vocab_size: int, tp_sizes: Sequence[int], divisible_by: int = 128) -> None:
    """The padded vocabulary at each TP size (Megatron's rule, :func:`pad_vocab_size`)."""
    for t in sorted(set(tp_sizes)):
        padded = pad_vocab_size(vocab_size, divisible_by, t)
        print(f"TP={t}: a multiple of {divisible_by} x {t} = {divisible_by * t}: {padded} rows = "
              f"{vocab_size} real + {padded - vocab_size} dummy, {padded // t} per rank")


def padding_demo_tp(vocab_size: int, saved_tp: int, resume_tp: int,
                    divisible_by: int = 128) -> int:
    """``resume_tp`` when its padding differs from ``saved_tp``'s; else the smallest power of
    two above both whose padding differs (the TP size the lesson loads the checkpoint at)."""
    saved = pad_vocab_size(vocab_size, divisible_by, saved_tp)
    if pad_vocab_size(vocab_size, divisible_by, resume_tp) != saved:
        return resume_tp
    t = 1 << max(saved_tp, resume_tp).bit_length()
    while pad_vocab_size(vocab_size, divisible_by, t) == saved:
        t *= 2
    return t


def _iteration_batches(args, iteration: int) -> List[Dict[str, torch.Tensor]]:
    """The micro-batches of 1-based ``iteration`` at ``args``' layout, as the dense twin reads
    them (every data-parallel replica's, in order)."""
    m_total = args.num_micro_batches * args.data_parallel_size
    data = datasets.build_dataset(args.data_path, args.global_batch_size * iteration,
                                  args.seq_length, args.vocab_size, args.seed)
    return [datasets.collate([data[i] for i in datasets.batch_indices(
        iteration - 1, m, args.micro_batch_size, 0, 1, m_total)]) for m in range(m_total)]


def _twin(args, state_dict) -> PlainGPT:
    rows = state_dict[checkpointing.TIED_EMBEDDING].shape[0]
    twin = PlainGPT.from_config(training.model_config(args), rows, args.max_position_embeddings)
    twin.load_state_dict(state_dict)
    return twin.to("cuda" if torch.cuda.is_available() else "cpu").eval()


def repad_effect(checkpoint, flags: Sequence, tp: int, iteration: int) -> Dict[str, object]:
    """Load ``checkpoint`` (consolidated, in this process) as a run of ``flags`` at TP=``tp``
    would, and run the dense twin on the batch of ``iteration`` with the saved table and with
    the re-padded one: rows, the largest change of a real id's logit, the loss over the padded
    vocabulary before and after, the rise predicted from the saved logits alone (each zero row
    adds a logit 0, so ``log(1 + new rows / sum exp(saved logits))`` per token), and the loss
    over the real ids only."""
    # One process, one replica (as every job of the lab: each runs TP ranks, so DP = 1); the
    # padded size is the one TP=``tp`` gives, which need not be a valid layout for this model.
    args = training.validate_args(training.parse_args([str(f) for f in flags]), 1,
                                  check_load=False)
    rows = pad_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, tp)
    saved = checkpointing.consolidate(checkpoint)
    table = saved[checkpointing.TIED_EMBEDDING]
    repadded = dict(saved)
    repadded[checkpointing.TIED_EMBEDDING] = vocab_padding.repadded_rows(table, 0, rows)
    V, before, after = args.vocab_size, _twin(args, saved), _twin(args, repadded)
    out = dict(vocab_size=V, saved_rows=table.shape[0], rows=rows, tp=tp,
               saved_tp=checkpointing.read_checkpoint_info(checkpoint)["tensor_model_parallel_size"])
    sums = {k: 0.0 for k in ("loss_before", "loss_after", "rise_predicted", "real_before",
                             "real_after", "logit_change")}
    batches = _iteration_batches(args, iteration)
    device = next(before.parameters()).device
    with torch.no_grad():
        for batch in batches:
            tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
            z0, z1 = before(tokens).float(), after(tokens).float()
            y = labels.unsqueeze(-1)
            for key, z in (("before", z0), ("after", z1)):
                sums[f"loss_{key}"] += float((z.logsumexp(-1) - z.gather(-1, y).squeeze(-1)).mean())
                zr = z[..., :V]
                sums[f"real_{key}"] += float((zr.logsumexp(-1) - zr.gather(-1, y).squeeze(-1)).mean())
            added = max(0, rows - table.shape[0])
            kept = z0[..., :min(rows, table.shape[0])].logsumexp(-1)
            if added:   # each zero row adds exp(0) = 1 to the softmax's denominator
                kept = torch.logaddexp(kept, torch.full_like(kept, math.log(added)))
            sums["rise_predicted"] += float((kept - z0.logsumexp(-1)).mean())
            sums["logit_change"] = max(sums["logit_change"],
                                       float((z1[..., :V] - z0[..., :V]).abs().max()))
    n = len(batches)
    out.update({k: (v if k == "logit_change" else v / n) for k, v in sums.items()})
    out["counts"] = vocab_padding.row_counts(V, table.shape[0], rows)
    out["iteration"] = iteration
    return out


def print_repad_effect(effect: Dict[str, object]) -> None:
    e = effect
    print(f"saved at TP={e['saved_tp']}: {e['saved_rows']} rows; loaded at TP={e['tp']}: "
          f"{e['rows']} rows")
    print(fit("the loader: " + vocab_padding.describe(e["vocab_size"], e["saved_rows"], e["rows"])))
    print(f"on the batch of iteration {e['iteration']}, the dense twin with the saved table and "
          f"with the re-padded one:")
    print(f"  largest change of a real id's logit: {e['logit_change']:.3g}")
    print(f"  loss over the padded vocabulary: {e['loss_before']:.4f} -> {e['loss_after']:.4f} "
          f"({e['loss_after'] - e['loss_before']:+.4f})")
    print(f"  predicted from the saved logits (mean log(sum exp(kept) + added) - "
          f"log(sum exp(saved))): {e['rise_predicted']:+.4f}")
    print(f"  loss over the {e['vocab_size']} real ids only: {e['real_before']:.4f} -> "
          f"{e['real_after']:.4f}")


def print_resume_check(resumed: TrainRun, run: TrainRun, effect: Optional[Dict[str, object]],
                       rtol: float) -> bool:
    """After a resume: with the padding unchanged, the resumed losses must follow ``run``
    (``rtol``); with it changed, its first loss must be the one :func:`repad_effect`
    worked out for that iteration, and the curves need not coincide after it."""
    if effect is None or effect["rows"] == effect["saved_rows"]:
        return print_agreement([resumed], run, rtol=rtol)
    first, logged = resumed.iterations[0], resumed.losses[0]
    ok = first == effect["iteration"] and abs(logged - effect["loss_after"]) <= rtol * abs(logged)
    print(f"{resumed.label}, iteration {first}: logged {logged:.4f}; the dense twin with the "
          f"re-padded table: {effect['loss_after']:.4f} "
          f"({'the same loss' if ok else 'DIFFERENT'} within {rtol:g}); {run.label} logged "
          f"{dict(zip(run.iterations, run.losses)).get(first, float('nan')):.4f} over "
          f"{effect['saved_rows']} rows")
    return ok
