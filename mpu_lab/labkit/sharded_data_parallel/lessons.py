"""Lab 05's runs and tables: Megatron-FSDP's four strategies
(``--use-megatron-fsdp --data-parallel-sharding-strategy S``) side by side.

* :func:`strategy_flags`, :func:`run_strategies` — one ``launch/train_gpt.py`` job per strategy,
  started together (:func:`mpu_lab.labkit.data_parallel.lessons.train_together`); each logs
  rank 0's resident ``param_bytes``, ``grad_bytes``, ``optimizer_state_bytes`` (counted from
  the tensors it holds, :mod:`mpu_lab.training.resident_bytes`);
* :func:`unit_numels`, :func:`print_resident` — those counts against ZeRO's formula
  (:func:`mpu_lab.perf.cost_model.fsdp.resident_bytes_per_rank`), the padding explained;
* :func:`transient_bytes`, :func:`print_peaks` — the peak inside a step that the counts after
  it do not show: the whole parameters of the units gathered at once, the whole gradients
  before their reduce-scatter;
* :func:`count_step_collectives` (runs on a playground rank), :func:`print_step_bytes` — the
  collectives of one training step seen by ``CommDebugMode``, their ring bytes against
  :func:`mpu_lab.perf.cost_model.fsdp.data_parallel_bytes_per_step`.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch.distributed as dist

from mpu_lab import training
from mpu_lab.core import parallel_state
from mpu_lab.labkit.c10d_calls import C10dCalls
from mpu_lab.labkit.data_parallel import lessons as dp_lessons
from mpu_lab.labkit.train_gpt import runs as gpt_runs
from mpu_lab.perf.cost_model import ModelShape
from mpu_lab.perf.cost_model import fsdp as fsdp_model

STRATEGIES = fsdp_model.DATA_PARALLEL_SHARDING_STRATEGIES
ZERO_NAMES = {"no_shard": "DDP", "optim": "ZeRO-1", "optim_grads": "ZeRO-2",
              "optim_grads_params": "ZeRO-3"}
KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes")
SCALAR = 64      # collectives of at most this many elements are the loss and the grad norm


def strategy_flags(strategy: str, d: int, steps: int, layers: int, hidden: int, heads: int,
                   seq_length: int, vocab_size: int, micro_batch: int) -> List[str]:
    """``train_gpt.py`` flags for ``strategy`` at DP = ``d``: one micro-batch per rank (the
    global batch ``d x micro_batch``), so one step is one forward and one backward."""
    return gpt_runs.gpt_flags(steps, layers, hidden, heads, seq_length, micro_batch,
                              vocab_size=vocab_size, global_batch_size=d * micro_batch,
                              use_megatron_fsdp=True,
                              data_parallel_sharding_strategy=fsdp_model.check_strategy(strategy))


def run_strategies(d: int, env: Optional[Dict[str, str]] = None, **model) -> Dict[str, object]:
    """The four strategies' ``train_gpt.py`` jobs at DP = ``d``, side by side:
    ``{strategy: TrainRun}``."""
    jobs = {s: (strategy_flags(s, d, **model), d, s) for s in STRATEGIES}
    return dp_lessons.train_together(jobs, env=env)


def resident(run) -> Dict[str, int]:
    """Rank 0's counted bytes after the last logged step."""
    last = run.results[0]["metrics"][-1]
    return {k: int(last[k]) for k in KEYS}


def unit_numels(layers: int, hidden: int, seq_length: int, vocab_size: int) -> List[int]:
    """Parameters of Megatron-FSDP's units of the GPT (one unit per ``TransformerLayer``, and
    the root: word and position embeddings and the final LayerNorm, the output layer tied):
    ``[root, layer, ..., layer]``. A layer is 12h² + 13h (Narayanan et al. 2021, §5.1)."""
    shape = ModelShape(layers, hidden, 1, seq_length, vocab_size)
    layer = 12 * shape.h * shape.h + 13 * shape.h
    return [(shape.V + shape.s) * shape.h + 2 * shape.h] + [layer] * layers


def padded(numel: int, d: int) -> int:
    """``numel`` rounded up to a multiple of ``d`` (each rank an equal shard)."""
    return -(-numel // d) * d


def print_units(units: Sequence[int], d: int) -> None:
    """Each unit's elements and its padding to a multiple of ``d``."""
    names = ["root"] + [f"layer {i}" for i in range(len(units) - 1)]
    print(f"{'unit':>8} {'elements':>10} {'padded to':>10} {'padding':>8}")
    for name, n in zip(names, units):
        print(f"{name:>8} {n:>10,} {padded(n, d):>10,} {padded(n, d) - n:>8}")
    print(f"{'all':>8} {sum(units):>10,} {sum(padded(n, d) for n in units):>10,} "
          f"{sum(padded(n, d) - n for n in units):>8}")


def print_resident(runs: Dict[str, object], units: Sequence[int], d: int,
                   rtol: float = 0.01) -> None:
    """Rank 0's counted bytes per strategy next to the formula for Ψ = ``sum(units)``
    parameters (fp32 weight and gradient, Adam's two fp32 moments), and whether each count is
    within ``rtol`` of it (what is left: the padding, and AdamW's 4-byte step per tensor)."""
    psi = sum(units)
    print(f"Ψ = {psi:,} parameters, d = {d}; KiB on rank 0, counted / formula")
    print(f"{'strategy':>19} {'':>7} {'weights':>15} {'gradients':>15} {'Adam states':>15}"
          f" {'total':>8}")
    worst = 0.0
    for s in STRATEGIES:
        got, formula = resident(runs[s]), fsdp_model.resident_bytes_per_rank(s, psi, d)
        cells = " ".join(f"{got[k] / 1024:>7.1f}/{formula[k] / 1024:<7.1f}" for k in KEYS)
        worst = max(worst, *(abs(got[k] - formula[k]) / formula[k] for k in KEYS))
        print(f"{s:>19} {ZERO_NAMES[s]:>7} {cells} {sum(got.values()) / 1024:>8.1f}")
    ok = worst <= rtol
    print(f"every count within {rtol:.0%} of the formula: {'yes' if ok else 'no'} "
          f"(largest difference {worst:.2%})")


def ratios(runs: Dict[str, object]) -> None:
    """Each count relative to ``no_shard``'s: where ZeRO's stages cut by d."""
    base = resident(runs["no_shard"])
    print(f"{'strategy':>19} " + " ".join(f"{k:>22}" for k in KEYS))
    for s in STRATEGIES:
        got = resident(runs[s])
        print(f"{s:>19} " + " ".join(f"{got[k] / base[k]:>22.3f}" for k in KEYS))


def print_same_losses(runs: Dict[str, object], bound: float = 1e-5) -> None:
    """Every strategy's losses (4 decimals: what survives another CPU) and whether each is
    within ``bound`` (relative) of ``no_shard``'s at every step."""
    print(f"{'iteration':>9} " + "".join(f"{s:>19}" for s in STRATEGIES))
    ref = runs["no_shard"]
    for i, it in enumerate(ref.iterations):
        print(f"{it:>9} " + "".join(f"{runs[s].losses[i]:>19.4f}" for s in STRATEGIES))
    for s in STRATEGIES[1:]:
        worst = gpt_runs.max_relative_difference(runs[s], ref)
        print(f"{s} vs no_shard: {'equal' if worst <= bound else 'NOT equal'} within "
              f"{bound:.0e} (relative) at every step".replace("e-0", "e-"))


# --------------------------------------------------------------------------- the peak
def transient_bytes(strategy: str, units: Sequence[int], d: int) -> Dict[str, float]:
    """Bytes of weights and gradients a rank holds at its peak inside a step (fp32, 4 bytes),
    modelled after the mirror's Megatron-FSDP (``megatron_fsdp.py``'s docstring): the resident
    shards or whole buffers, plus under ``optim_grads_params`` the whole weights of the root
    and of the two largest units (one computing, the next prefetched), and under the
    strategies that shard gradients the whole gradients of the root (until the end of backward)
    and of the two largest units (the one whose backward just ended, the one whose
    reduce-scatter is in flight). ``units``: ``[root, unit, ...]`` elements."""
    psi = sum(padded(n, d) for n in units)
    root, rest = padded(units[0], d), sorted((padded(n, d) for n in units[1:]), reverse=True)
    busy = root + sum(rest[:2])
    shard = psi / d
    if strategy in ("no_shard", "optim"):
        return dict(weights=4 * psi, gradients=4 * psi)
    weights = 4 * psi if strategy == "optim_grads" else 4 * (shard + busy)
    return dict(weights=weights, gradients=4 * (shard + busy))


def print_peaks(layouts: Dict[str, Sequence[int]], d: int) -> None:
    """For each layout of units, the modelled peak of weights and gradients per strategy, in
    multiples of the whole fp32 model (4 bytes x its padded parameters), whether the root and
    two units (what ZeRO-3 holds whole at its peak, one unit prefetched) are the whole model,
    and whether ``optim_grads`` peaks above ``optim`` in gradients."""
    for name, units in layouts.items():
        whole = 4 * sum(padded(n, d) for n in units)
        print(f"{name}: {len(units) - 1} unit(s) + root, d = {d}")
        print(f"  the root and two units are the whole model: "
              f"{'yes' if len(units) - 1 <= 2 else 'no'}")
        print(f"  {'peak, x the whole fp32 model':>28} {'weights':>8} {'gradients':>10}")
        peaks = {s: transient_bytes(s, units, d) for s in STRATEGIES}
        for s in STRATEGIES:
            print(f"  {s:>28} {peaks[s]['weights'] / whole:>8.3f} "
                  f"{peaks[s]['gradients'] / whole:>10.3f}")
        above = peaks["optim_grads"]["gradients"] > peaks["optim"]["gradients"]
        print(f"  optim_grads' gradient peak above optim's: {'yes' if above else 'no'}")


# --------------------------------------------------------------------------- bytes per step
def count_step_collectives(flags: Sequence[str]) -> Dict[str, object]:
    """Runs on every rank of a playground world: ``train_gpt.py``'s setup for ``flags`` on the
    world (:func:`mpu_lab.training.setup`), then one training step under ``CommDebugMode``
    (:class:`~mpu_lab.labkit.c10d_calls.C10dCalls`). Returns the data-parallel collectives
    (more than :data:`SCALAR` elements: the loss average and the grad norm left out) as
    ``[[kind, input bytes], ...]``, the padded gradient elements Ψ of the wrapper's buffers,
    and the group size. The world keeps the groups the setup made (TP = PP = 1, as
    ``flags`` asks)."""
    args = training.validate_args(training.parse_args(list(flags) + ["--quiet"]),
                                  dist.get_world_size())
    state = training.setup(args, log=lambda text: None)
    with C10dCalls() as calls:
        training.train_step(state)
    chunk = state.ddp_chunks[0]
    groups = getattr(chunk, "parameter_groups", None)
    psi = sum(g.numel for g in groups) if groups else chunk.buffer.grad_data.numel()
    seen = [[c.what, c.nbytes] for c in calls.calls
            if sum(t.numel() for t in c.tensors) > SCALAR]
    return dict(calls=seen, psi=psi, d=parallel_state.get_data_parallel_world_size())


def step_bytes(counted: Dict[str, object]) -> Dict[str, float]:
    """Ring bytes one rank sends, by kind, for the collectives of :func:`count_step_collectives`."""
    out: Dict[str, float] = {}
    for kind, nbytes in counted["calls"]:
        key = kind.replace("-", "_")
        out[kind] = out.get(kind, 0.0) + fsdp_model.ring_bytes(key, nbytes, counted["d"])
    return out


def print_step_bytes(counted: Dict[str, Dict[str, object]], rtol: float = 1e-6) -> None:
    """Per strategy: the collectives seen, their ring bytes, and the formula for Ψ."""
    print(f"{'strategy':>19} {'collectives seen (count)':>40} {'KiB sent':>9} {'formula':>8}")
    moved = {}
    for s, c in counted.items():
        kinds = [k for k, _ in c["calls"]]
        seen = ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds)))
        sent = sum(step_bytes(c).values())
        formula = fsdp_model.data_parallel_bytes_per_step(s, 4 * c["psi"], c["d"])
        moved[s] = (sent, formula)
        print(f"{s:>19} {seen:>40} {sent / 1024:>9.1f} {formula / 1024:>8.1f}")
    ok = all(abs(a - b) <= rtol * b for a, b in moved.values())
    print(f"counted = formula for every strategy (relative {rtol:g}): {'yes' if ok else 'no'}")
    if "no_shard" in moved and "optim_grads_params" in moved:
        print(f"optim_grads_params / no_shard: "
              f"{moved['optim_grads_params'][0] / moved['no_shard'][0]:.2f} x "
              f"(Ψ {counted['no_shard']['psi']:,} and {counted['optim_grads_params']['psi']:,} "
              f"elements, padded)")
