"""Lab 04's drivers and printed lessons: data parallelism as Megatron does it.

* :func:`print_dp_groups`, :func:`live_dp_groups` — the data-parallel groups, from the pure
  rank-group arithmetic of :mod:`mpu_lab.core.parallel_state` and from a live playground world;
* :func:`same_batch_flags`, :func:`train_together`, :func:`print_same_batch` — ``train_gpt.py``
  at DP = 1 and DP = d (and with the distributed optimizer) on one global batch, the jobs side
  by side: the same losses, step by step; :func:`print_critical_batch` — the
  steps and samples a larger batch costs (McCandlish et al. 2018);
* :func:`print_toy_layout` — the mirror's
  :class:`~mpu_lab.core.distributed.param_and_grad_buffer.ParamAndGradBuffer` for a toy model: reverse order, buckets, padding to a multiple of d, each rank's shard;
  :func:`print_started_in_backward` — from :mod:`mpu_lab.perf.dp_overlap`'s run, which bucket
  reductions started during backward (``--overlap-grad-reduce``);
* :func:`print_bytes_per_parameter` — from :mod:`mpu_lab.perf.memory_breakdown`'s rows, the measured
  bytes per parameter of weights, gradients and optimizer states, next to mpu_lab's fp32 figure
  (:func:`mpu_lab.perf.memory_breakdown.mpu_lab_bytes_per_parameter`); :func:`print_megatron_bytes` —
  Megatron-core's table (:func:`mpu_lab.perf.cost_model.bytes_per_parameter`) next to it;
* :func:`timing_ranks`, :func:`print_overlap_verdict` — the overlap lesson sized to the
  machine (no more ranks than cores, each pinned) and what its measurement shows;
* :func:`print_memory_table` — the memory job's table, one line per group of ranks that
  printed the same;
* :func:`fit_counts`, :func:`print_fit_counts` — lab 16's explorer with and without the
  distributed optimizer (a "going further": the explorer is taught in lab 16).
"""
from __future__ import annotations

import concurrent.futures
import statistics
import textwrap
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from mpu_lab.core import parallel_state
from mpu_lab.core.distributed.param_and_grad_buffer import ParamAndGradBuffer
from mpu_lab.labkit.train_gpt import runs as gpt_runs
from mpu_lab.labkit.rank_groups.viz import format_groups
from mpu_lab.perf import explore
from mpu_lab.perf.dp_overlap import overlap_saving
from mpu_lab.perf.cost_model import bytes_per_parameter_terms
from mpu_lab.perf.memory_breakdown import format_memory_table, mpu_lab_bytes_per_parameter
from mpu_lab.perf.rank_clock import cores_note, usable_cores


# --------------------------------------------------------------------------- 1. groups
def print_dp_groups(world_size: int, tp: int, pp: int = 1) -> None:
    """The data- and tensor-parallel groups of a job, from ``generate_rank_groups``, and which
    ranks hold the same weights (the members of one data-parallel group)."""
    groups = parallel_state.generate_rank_groups(world_size, tp, pp)
    d = world_size // (tp * pp)
    print(f"n = {world_size} = t x p x d = {tp} x {pp} x {d}")
    print(format_groups(groups, ["dp", "tp"]))
    for g in groups["dp"][:2]:
        print(f" ranks {g} hold the same shard of the weights; each trains on its own 1/{d} of "
              f"the batch,\n   and they average their gradients")


def rank_dp_group() -> List[int]:
    """Runs on a rank: the global ranks of its data-parallel process group."""
    return dist.get_process_group_ranks(parallel_state.get_data_parallel_group())


def live_dp_groups(world) -> List[List[int]]:
    """Each rank's data-parallel group (global ranks), as the world's processes built it."""
    return world.run(rank_dp_group)


# --------------------------------------------------------------------------- 2. one big batch
def same_batch_flags(steps: int, layers: int, hidden: int, heads: int, seq_length: int,
                     vocab_size: int, global_batch: int, micro_batch: int) -> List[str]:
    """``train_gpt.py`` flags of section 2: one global batch whatever the data-parallel size
    (the micro-batches per replica follow: B / (b d))."""
    return gpt_runs.gpt_flags(steps, layers, hidden, heads, seq_length, micro_batch=micro_batch,
                              global_batch_size=global_batch, vocab_size=vocab_size)


def train_together(jobs: Dict[object, Tuple[Sequence, int, str]],
                   env: Optional[Dict[str, str]] = None) -> Dict[object, "gpt_runs.TrainRun"]:
    """Several :func:`mpu_lab.labkit.train_gpt.runs.train` jobs at once, one thread each:
    ``{key: (flags, nproc, label)}`` -> ``{key: TrainRun}``. Small jobs spend much of their
    time starting processes and waiting in collectives, so running them side by side shortens
    the wait; each job's losses are its own (the runs are deterministic)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {key: pool.submit(gpt_runs.train, flags, nproc, label, env=env)
                   for key, (flags, nproc, label) in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


def print_same_batch(runs: Sequence["gpt_runs.TrainRun"], reference: "gpt_runs.TrainRun",
                     bound: float = 1e-5) -> None:
    """Each run's loss per step beside the reference's, and whether every step agrees within
    ``bound`` (relative). Losses are printed to 4 decimals and agreement as a yes/no against
    the printed bound: float32 sums land a few ulps apart on another CPU or thread count
    (6.113932 on one machine, 6.113933 on the next), so more digits would record the machine,
    not the lesson."""
    shown = f"{bound:.0e}".replace("e-0", "e-")          # 1e-5, as the lesson writes it
    print("iteration " + "".join(f"{r.label:>12}" for r in [reference, *runs])
          + f"   within {shown}")
    ref = dict(zip(reference.iterations, reference.losses))
    for i, it in enumerate(reference.iterations):
        losses = [ref[it]] + [r.losses[i] for r in runs]
        diff = max(abs(v - ref[it]) / abs(ref[it]) for v in losses[1:])
        print(f"{it:>9} " + "".join(f"{v:>12.4f}" for v in losses)
              + f"   {'yes' if diff <= bound else 'no'}")
    for r in runs:
        worst = gpt_runs.max_relative_difference(r, reference)
        verdict = (f"equal within {shown} at every step (relative; fp32 rounding)"
                   if worst <= bound else
                   f"NOT equal within {shown}: largest relative difference {worst:.1e}")
        print(f"{r.label} vs {reference.label}: {verdict}")


def critical_batch_rows(ratios: Sequence[float]) -> List[Dict[str, float]]:
    """McCandlish et al. 2018 §2.3: to reach a given loss, a batch B takes
    S = S_min (1 + B_crit / B) steps and E = E_min (1 + B / B_crit) samples; ``ratios`` are
    B / B_crit."""
    return [dict(ratio=r, steps=1 + 1 / r, samples=1 + r) for r in ratios]


def print_critical_batch(ratios: Sequence[float] = (0.125, 0.25, 0.5, 1, 2, 4, 8)) -> None:
    """The trade-off as a table: each doubling of the batch, what it does to steps and data."""
    print("B / B_crit   steps / S_min   samples / E_min   steps saved by doubling B")
    rows = critical_batch_rows(ratios)
    for row, nxt in zip(rows, rows[1:] + [None]):
        saved = "" if nxt is None or nxt["ratio"] != 2 * row["ratio"] else \
            f"{1 - nxt['steps'] / row['steps']:.0%}"
        print(f"{row['ratio']:>10g}   {row['steps']:>13.3f}   {row['samples']:>15.3f}   "
              f"{saved:>25}")


# --------------------------------------------------------------------------- 3. buckets
def print_toy_layout(sizes: Sequence[int], d: int, bucket_size: Optional[int]) -> None:
    """The buffer layout of a toy model whose parameters have ``sizes`` elements, in the order
    ``module.parameters()`` gives them (p0 first): :class:`ParamAndGradBuffer` over ``d``
    data-parallel ranks with ``bucket_size``; each bucket, its parameters in buffer order,
    its padding and each rank's shard. Pure: no process group needed."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]  # cpu: a layout, no rank
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    buf = ParamAndGradBuffer(params, d, bucket_size)
    print(f"{len(sizes)} parameters p0..p{len(sizes) - 1} of {list(sizes)} elements, d = {d}, "
          f"bucket_size = {bucket_size}:\n{len(buf.buckets)} buckets, {buf.numel_unpadded} "
          f"elements + {buf.numel - buf.numel_unpadded} of padding = {buf.numel}")
    for b in buf.buckets:
        where = ", ".join(f"{names[id(p)]} [{buf.param_range(p)[1]}, {buf.param_range(p)[2]})"
                          for p in b.params)
        shards = " ".join("r{}:[{}, {})".format(r, *b.shard_range(r)) for r in range(d))
        print(f"bucket {b.index}: {where}, padding {b.numel - b.numel_unpadded} -> "
              f"{b.numel} elements\n  shards (in the bucket) {shards}")


def print_started_in_backward(result) -> None:
    """Per mode of a :func:`mpu_lab.perf.dp_overlap.run_dp_overlap` result: how many bucket
    reductions of the last timed step started during backward, on every rank."""
    for mode in result.modes:
        counts = [(sum(s["started_in_backward"] for s in rec["steps"][-1]["syncs"]),
                   len(rec["steps"][-1]["syncs"])) for rec in result.mode(mode)]
        same = len(set(counts)) == 1
        text = (f"{counts[0][0]} of {counts[0][1]} on every rank" if same
                else ", ".join(f"rank {r}: {k} of {n}" for r, (k, n) in enumerate(counts)))
        print(f"{mode:<32} buckets started during backward: {text}")


def timing_ranks(world_size: int, device: Optional[str] = None) -> int:
    """Ranks for the overlap timing: ``world_size`` on GPUs (a device per rank); on a CPU as
    many as it has usable cores, at least 2 (data parallelism needs two) and at most
    ``world_size``: a rank that shares a core lends it out while it waits, and the timing
    would show the sharing, not the overlap. ``device``: "cpu" or "cuda" (default: "cuda"
    where torch sees a GPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        return world_size
    return max(2, min(world_size, len(usable_cores())))


#: the relative difference of two step times below which the verdict calls them the same
OVERLAP_TOLERANCE = 0.05


def overlap_parts(result) -> List[dict]:
    """Per mode pair, without and with overlap: the step, its backward, its exposed
    communication and the rest (forward, optimizer, waiting: step - backward - exposed), each
    the median over steps and the mean over ranks, so that the parts add up to the step."""
    rows = []
    for r in overlap_saving(result):
        row = dict(mode=r["mode"])
        for key, mode in (("off", r["mode"]), ("on", r["mode"] + " + overlap")):
            backward = statistics.fmean(statistics.median(s["backward_ms"] for s in rec["steps"])
                                        for rec in result.mode(mode))
            step, exposed = r["step_overlap_ms" if key == "on" else "step_ms"], \
                r["exposed_overlap_ms" if key == "on" else "exposed_ms"]
            row[key] = dict(step=step, backward=backward, exposed=exposed,
                            rest=step - backward - exposed)
        row["change"] = row["on"]["step"] / row["off"]["step"] - 1
        rows.append(row)
    return rows


def overlap_verdict(change: float, tolerance: float = OVERLAP_TOLERANCE) -> str:
    """The verdict on a step's relative change with overlap: a saving or a loss only beyond
    ``tolerance`` (relative), else the same."""
    if change <= -tolerance:
        return f"a saving of {-100 * change:.0f} %"
    if change >= tolerance:
        return f"a loss of {100 * change:.0f} %"
    return f"no difference (within {100 * tolerance:.0f} %)"


def print_overlap_verdict(result) -> None:
    """What the overlap run measured, said plainly: per mode pair the step and its parts
    (backward, exposed communication, the rest) without and with overlap, a verdict computed
    from those step times with a stated relative tolerance, and on a CPU why it cannot show
    the GPU's saving."""
    print(f"measured on d = {result.d} ranks ({result.device}"
          + (", each pinned to a core of its own, one thread)" if result.device == "cpu"
             and all(r.get("core", -1) >= 0 for r in result.reports) else ")"))
    print("ms per step (median over steps, mean over ranks); step = backward + exposed "
          "communication + rest")
    print(f"  {'mode':<31} {'overlap':>7} {'step':>6} {'backward':>8} {'exposed':>7} {'rest':>6}")
    rows = overlap_parts(result)
    for r in rows:
        for key in ("off", "on"):
            v = r[key]
            print(f"  {r['mode']:<31} {key:>7} {v['step']:6.1f} {v['backward']:8.1f} "
                  f"{v['exposed']:7.1f} {v['rest']:6.1f}")
    for r in rows:
        print(f"  {r['mode']}: step {r['off']['step']:.1f} -> {r['on']['step']:.1f} ms with "
              f"overlap: {overlap_verdict(r['change'])}")
    note = cores_note(result.d)
    if note:
        print("  " + note)
    for r in rows:
        took = r["off"]["exposed"] - r["on"]["exposed"]
        added = r["on"]["backward"] - r["off"]["backward"]
        print(f"  {r['mode']}: overlap took {took:.1f} ms off the exposed time and added "
              f"{added:.1f} ms to backward")
    if result.device == "cpu":
        saving = [r["mode"] for r in rows if r["change"] <= -OVERLAP_TOLERANCE]
        shown = ("a saving." if rows and len(saving) == len(rows) else "no clear saving."
                 if not saving else f"a saving in {len(saving)} of {len(rows)} modes "
                 f"({', '.join(saving)}).")
        print(textwrap.fill(
            f"this machine shows {shown} On a CPU it cannot show the GPU's: gloo's all-reduce "
            f"is work (copying and adding the buckets over loopback sockets) done by the same "
            f"core that computes backward, so overlap only interleaves the two on that core: "
            f"what it takes off the exposed time comes back, in part or in whole, in "
            f"backward's (the lines above). On a GPU the reduction runs on NVLink / the "
            f"network beside the compute kernels.", 98, initial_indent="  ",
            subsequent_indent="  "))


# --------------------------------------------------------------------------- 4. memory
def _rank_label(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def print_memory_table(rows: Sequence[dict]) -> None:
    """:func:`mpu_lab.perf.memory_breakdown.format_memory_table` with the ranks whose printed figures are
    the same merged into one line ("0-3"): the data-parallel replicas."""
    by_key: Dict[tuple, Dict[int, list]] = {}
    for r in rows:
        by_key.setdefault((r["config"], r["optimizer"]), {}).setdefault(r["rank"], []).append(r)
    merged = []
    for per_rank in by_key.values():
        groups: Dict[tuple, List[int]] = {}
        for rank, rs in per_rank.items():
            # what the table prints (KiB to 0.1): shards that differ by a few padding bytes
            # are the same line
            sig = tuple(sorted((x["term"], round(x["measured"] / 1024, 1),
                                round(x["predicted"] / 1024, 1)) for x in rs))
            groups.setdefault(sig, []).append(rank)
        for ranks in groups.values():
            merged += [dict(x, rank=_rank_label(ranks)) for x in per_rank[ranks[0]]]
    print(format_memory_table(merged))


def print_bytes_per_parameter(rows: Sequence[dict]) -> None:
    """From :func:`mpu_lab.perf.memory_breakdown.run_memory_breakdown` rows: per configuration and
    optimizer, rank 0's measured bytes of parameters, gradients and optimizer states, per
    parameter (the parameter count is the fp32 parameter bytes / 4)."""
    cells: Dict[tuple, Dict[str, int]] = {}
    for r in rows:
        if r["rank"] == 0 and r["term"] in ("parameters", "gradients", "optimizer"):
            cells.setdefault((r["config"], r["optimizer"], r["dp"]), {})[r["term"]] = r["measured"]
    print("rank 0's bytes per parameter, measured:\n"
          "parameters + gradients + optimizer = total (mpu_lab's fp32 figure)")
    for (config, optimizer, d), got in cells.items():
        n = got["parameters"] / 4
        per = {k: got[k] / n for k in ("parameters", "gradients", "optimizer")}
        ours = mpu_lab_bytes_per_parameter(optimizer == "distributed", d)
        print(f"{config:<13} {optimizer:<12} {per['parameters']:.2f} + "
              f"{per['gradients']:.2f} + {per['optimizer']:.2f} = {sum(per.values()):.2f} "
              f"({ours:g})")


def format_megatron_bytes(data_parallel_size: int) -> str:
    """Megatron-core's bytes per parameter (its distributed-optimizer guide) for each pair of
    parameter and gradient dtypes, from :func:`mpu_lab.perf.cost_model.bytes_per_parameter_terms`:
    what every rank keeps, what the optimizer keeps (the distributed optimizer splits it over
    the d ranks), the sum without and with it, and that sum at ``data_parallel_size``. Lines
    of at most 100 characters: "main" is an fp32 main copy, m and v are Adam's moments."""
    d = data_parallel_size
    if d < 1 or int(d) != d:
        raise ValueError(f"data_parallel_size must be a whole number >= 1, got {d!r}")
    short = {"fp32 main param": "main param", "fp32 main grad": "main grad", "Adam m": "m",
             "Adam v": "v"}
    header = ("params / grads", "every rank keeps", "the optimizer keeps", "plain",
              "dist. opt.", f"d = {d}")
    rows = []
    for params, grads in (("fp16", "fp16"), ("bf16", "fp32"), ("fp32", "fp32")):
        terms = bytes_per_parameter_terms(params, grads)
        kept, split = sum(terms["replicated"].values()), sum(terms["sharded"].values())
        rows.append((f"{params} / {grads}",
                     " + ".join(f"{v} {k}" for k, v in terms["replicated"].items()),
                     " + ".join(f"{v} {short.get(k, k)}" for k, v in terms["sharded"].items()),
                     str(kept + split), f"{kept} + {split}/d", f"{kept + split / d:g}"))
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    right = {3, 4, 5}
    lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w)
                       for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in [header] + rows]
    return "\n".join(["Megatron-core's bytes per parameter (its distributed-optimizer guide)",
                      "main: an fp32 main copy; m, v: Adam's moments; dist. opt.: with the "
                      "distributed optimizer"] + lines)


def print_megatron_bytes(data_parallel_size: int) -> None:
    """Print :func:`format_megatron_bytes`."""
    print(format_megatron_bytes(data_parallel_size))


# --------------------------------------------------------------------------- 6. explorer
def fit_counts(model, cluster, num_gpus: int, global_batch_size: int) -> Dict[bool, tuple]:
    """``{distributed_optimizer: (fitting, total, best)}`` from lab 16's explorer."""
    out = {}
    for flag in (False, True):
        result = explore(model, cluster, num_gpus, global_batch_size,
                         distributed_optimizer=flag)
        out[flag] = (sum(c.fits for c in result.candidates), len(result.candidates), result.best)
    return out


def print_fit_counts(counts: Dict[bool, tuple]) -> None:
    for flag, (fits, total, best) in counts.items():
        c, p = best.config, best.prediction
        print(f"distributed optimizer {'on ' if flag else 'off'}: {fits:>3} of {total} "
              f"configurations fit;\n  the fastest t={c.tp} p={c.pp} d={c.dp} b={c.b}: "
              f"{p.total_s:.1f} s per iteration, {p.memory_gb:.1f} GB per GPU")
