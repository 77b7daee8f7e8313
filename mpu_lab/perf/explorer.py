"""Which (t, p, d, m) should I use? Enumerate every valid split of a model over N GPUs, predict
each with :func:`mpu_lab.perf.cost_model.predict_iteration`, rank them, and say in plain words
what is wrong with the bad ones — the answer to "why is my utilisation low".

    >>> from mpu_lab.perf import ModelShape, DGX_A100_80GB
    >>> from mpu_lab.perf.explorer import explore
    >>> gpt = ModelShape(num_layers=48, hidden_size=8192, num_attention_heads=64,
    ...                  seq_length=2048, vocab_size=51200)
    >>> result = explore(gpt, DGX_A100_80GB, num_gpus=128, global_batch_size=512)
    >>> print(result.table(top=8))                              # doctest: +SKIP
    >>> print(result.explain(result.worst_fitting()))          # doctest: +SKIP

A configuration is valid when t divides the heads (and the ffn size), p·v divides the layers,
t·p·d equals the GPU count and the global batch B is a multiple of b·d (m = B/(b·d)); the
interleaved schedule also needs m to be a multiple of p (Megatron's rule).

:meth:`Exploration.assumptions` says what the ranking took for granted (read from the
configurations and the cluster), :meth:`Exploration.ranking_under_error` how much of the
ranking survives a given error of the model.

Two worked examples rank splits with the newer dimensions: :func:`long_sequence_example`
(t, p, d, cp) for GPT-3 175B at a 32k sequence, where context parallelism is what makes it fit,
and :func:`moe_example` (t, p, d, ep) for Mixtral 8x7B (:mod:`mpu_lab.perf.cost_model.context`,
:mod:`mpu_lab.perf.cost_model.moe`).
"""
from __future__ import annotations

import dataclasses
import random
import re
from typing import Dict, List, Optional, Sequence

from mpu_lab.perf.cost_model import (Cluster, IterationPrediction, ModelShape, ParallelConfig,
                                     RECOMPUTE_MODES, bubble_fraction, bytes_per_parameter,
                                     bytes_per_parameter_terms, canonical_dtype,
                                     group_crosses_nodes,
                                     predict_iteration)
from mpu_lab.perf.cost_model import predict as predict_module
from mpu_lab.perf.cost_model.predict import pick_recompute, recompute_label  # noqa: F401
from mpu_lab.perf.explorer_examples import long_sequence_example, moe_example  # noqa: F401
from mpu_lab.perf.printing import fit
from mpu_lab.core.utils import divisors

__all__ = ["Candidate", "Exploration", "enumerate_configs", "explore", "diagnose",
           "RECOMPUTE_CHOICES", "recompute_label", "pick_recompute",
           "DEFAULT_THRESHOLDS", "not_modelled", "long_sequence_example", "moe_example"]

# When a share of the iteration counts as "bad" (plain-language flags).
DEFAULT_THRESHOLDS = dict(bubble=0.15, tp_comm=0.15, dp_comm=0.10, pp_p2p=0.05,
                          memory_headroom=0.0)


def not_modelled() -> List[str]:
    """What the cost model leaves out, read from the "Not modelled:" line of
    :mod:`mpu_lab.perf.cost_model.predict`'s docstring (the one place it is written)."""
    found = re.search(r"Not modelled:(.*?)\.\s*$", predict_module.__doc__ or "", re.S | re.M)
    if not found:
        raise RuntimeError("mpu_lab.perf.cost_model.predict's docstring lost its "
                           "'Not modelled:' line")
    return [" ".join(item.split()) for item in found.group(1).split(",")]


# explore(recompute=...): one mode, or "auto", the fastest that fits for each split
RECOMPUTE_CHOICES = RECOMPUTE_MODES + ("auto",)


def _switch(configs: Sequence[ParallelConfig], attr: str) -> str:
    values = {bool(getattr(c, attr)) for c in configs}
    return "mixed" if len(values) > 1 else ("on" if values.pop() else "off")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def enumerate_configs(model: ModelShape, num_gpus: int, global_batch_size: int,
                      micro_batch_sizes: Sequence[int] = (1, 2, 4, 8),
                      virtual_stages: Sequence[int] = (1,), sequence_parallel: bool = True,
                      recompute: str = "selective", **options) -> List[ParallelConfig]:
    """Every valid :class:`ParallelConfig` for ``model`` on ``num_gpus`` GPUs at batch
    ``global_batch_size``. ``sequence_parallel`` is switched on wherever t > 1 (it costs no extra
    communication, Korthikanti et al. 2022 §4.2.2); ``options`` go to every config (e.g.
    ``distributed_optimizer=True``). Raises ValueError for bad inputs, naming them."""
    _positive_int("num_gpus", num_gpus)
    _positive_int("global_batch_size", global_batch_size)
    if not micro_batch_sizes:
        raise ValueError("micro_batch_sizes is empty: give at least one, e.g. (1, 2, 4)")
    for b in micro_batch_sizes:
        _positive_int("micro-batch size", b)
    for v in virtual_stages:
        _positive_int("virtual_stages", v)
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    out = []
    for t in divisors(num_gpus):
        for p in divisors(num_gpus // t):
            d = num_gpus // (t * p)
            for b in sorted(set(micro_batch_sizes)):
                for v in sorted(set(virtual_stages)):
                    if v > 1 and p == 1:
                        continue
                    cfg = ParallelConfig(
                        tp=t, pp=p, dp=d, micro_batch_size=b,
                        global_batch_size=global_batch_size, virtual_stages=v,
                        sequence_parallel=sequence_parallel and t > 1
                        and model.seq_length % t == 0,
                        recompute=recompute, **options)
                    if not cfg.problems(model):
                        out.append(cfg)
    return out


def diagnose(prediction: IterationPrediction, thresholds: Optional[Dict[str, float]] = None
             ) -> List[str]:
    """Plain-language reasons a configuration runs slowly or not at all (empty: none found)."""
    th = dict(DEFAULT_THRESHOLDS, **(thresholds or {}))
    cfg, cl, pr = prediction.config, prediction.cluster, prediction
    share = pr.shares()
    reasons = []
    if not pr.fits:
        reasons.append(f"does not fit: {pr.memory_gb:.1f} GB per GPU needed, "
                       f"{cl.memory_bytes / 1e9:.0f} GB available (activations "
                       f"{pr.memory['activations'] / 1e9:.1f} GB, weights+grads+optimizer "
                       f"{(pr.memory['total'] - pr.memory['activations']) / 1e9:.1f} GB)")
    if group_crosses_nodes("tp", cfg, cl.gpus_per_node):
        reasons.append(f"TP group of {cfg.tp} crosses nodes ({cl.gpus_per_node} GPUs per node): "
                       f"every layer's all-reduces go over the "
                       f"{cl.inter_node_bandwidth / 1e9:.0f} GB/s network instead of "
                       f"{cl.intra_node_bandwidth / 1e9:.0f} GB/s NVLink")
    if share["tp_comm"] > th["tp_comm"]:
        reasons.append(f"tensor-parallel all-reduces take {share['tp_comm']:.0%} of the "
                       f"iteration (t={cfg.tp} is large for hidden size {pr.model.h})")
    if share["bubble"] > th["bubble"]:
        rel = bubble_fraction(cfg.pp, cfg.m, cfg.v)
        reasons.append(f"pipeline bubble is {share['bubble']:.0%} of the iteration: "
                       f"(p-1)/(v·m) = ({cfg.pp}-1)/({cfg.v}·{cfg.m}) = {rel:.2f} — "
                       f"more micro-batches (smaller b, larger B) or fewer stages")
    if share["dp_comm"] > th["dp_comm"]:
        where = "across nodes" if group_crosses_nodes("dp", cfg, cl.gpus_per_node) else \
            "inside a node"
        reasons.append(f"data-parallel gradient all-reduce ({where}) shows for "
                       f"{share['dp_comm']:.0%} of the iteration — overlap it with the backward "
                       f"pass or accumulate over more micro-batches")
    if share["pp_p2p"] > th["pp_p2p"]:
        reasons.append(f"pipeline send/recv takes {share['pp_p2p']:.0%} of the iteration")
    if cfg.pp > 1 and cfg.m < cfg.pp:
        reasons.append(f"only m={cfg.m} micro-batches for p={cfg.pp} stages: most stages idle "
                       f"most of the time")
    return reasons


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration with its prediction and its plain-language flags."""
    config: ParallelConfig
    prediction: IterationPrediction
    reasons: List[str]

    @property
    def fits(self) -> bool:
        return self.prediction.fits

    def short_flags(self) -> str:
        """Compact flags for a table: OOM, TP>node, bubble NN%, TP NN%, DP NN%, p2p NN%."""
        pr, cfg = self.prediction, self.config
        share = pr.shares()
        out = []
        if not pr.fits:
            out.append("OOM")
        if group_crosses_nodes("tp", cfg, pr.cluster.gpus_per_node):
            out.append("TP>node")
        for key, label in (("bubble", "bubble"), ("tp_comm", "TP"), ("dp_comm", "DP"),
                           ("pp_p2p", "p2p")):
            if share[key] > DEFAULT_THRESHOLDS[key]:
                out.append(f"{label} {share[key]:.0%}")
        return ",".join(out)

    def record(self) -> dict:
        """Flat, rounded dict (for plotting, DataFrames, JSON)."""
        c, pr = self.config, self.prediction
        rec = dict(t=c.tp, p=c.pp, d=c.dp, b=c.b, m=c.m, v=c.v, sp=c.sequence_parallel,
                   recompute=recompute_label(c),
                   time_s=round(pr.total_s, 4), tflops_per_gpu=round(pr.model_tflops_per_gpu, 1),
                   mfu=round(pr.mfu, 3), memory_gb=round(pr.memory_gb, 1), fits=pr.fits,
                   flags=self.short_flags())
        rec.update({k + "_share": round(v, 3) for k, v in pr.shares().items()})
        return rec


@dataclasses.dataclass
class Exploration:
    """The ranked candidates of :func:`explore`: fitting ones first, then by time per iteration
    (ties broken by (t, p, b, v) so the order is deterministic)."""
    model: ModelShape
    cluster: Cluster
    num_gpus: int
    global_batch_size: int
    candidates: List[Candidate]
    params_dtype: str = "fp16"      # the weights and gradients every prediction assumed
    grads_dtype: str = "fp16"

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def fitting(self) -> List[Candidate]:
        return [c for c in self.candidates if c.fits]

    def worst_fitting(self) -> Candidate:
        """The slowest configuration that fits in memory (a good "what not to do")."""
        fit = self.fitting()
        return fit[-1] if fit else self.candidates[-1]

    def find(self, t: int, p: int, b: Optional[int] = None, v: int = 1) -> Candidate:
        """The candidate with these sizes; ValueError if it is not among the valid ones."""
        for c in self.candidates:
            if (c.config.tp, c.config.pp, c.config.v) == (t, p, v) and \
                    (b is None or c.config.b == b):
                return c
        raise ValueError(f"(t={t}, p={p}, b={b}, v={v}) is not a valid configuration for "
                         f"{self.num_gpus} GPUs and batch {self.global_batch_size}")

    def records(self) -> List[dict]:
        """One flat dict per candidate, in rank order (data for plots)."""
        return [dict(rank=i + 1, **c.record()) for i, c in enumerate(self.candidates)]

    def table(self, top: Optional[int] = 10, only_fitting: bool = False) -> str:
        """A fixed-width text table of the ranking (rounded, deterministic)."""
        rows = self.fitting() if only_fitting else self.candidates
        rows = rows[:top] if top else rows
        # a recompute column only where the candidates differ in it (explore(recompute="auto"))
        mixed = len({recompute_label(c.config) for c in self.candidates}) > 1
        head = (f"{'#':>3} {'t':>3}{'p':>4}{'d':>5}{'b':>3}{'m':>6}{'v':>3}"
                + (f"{'recompute':>11}" if mixed else "")
                + f"{'time s':>9}{'TFLOP/s':>9}{'MFU':>6}{'mem GB':>8}  flags")
        lines = [f"{self.model.name or 'model'} on {self.num_gpus} GPUs ({self.cluster.name}), "
                 f"global batch {self.global_batch_size};\nTFLOP/s and MFU count model FLOPs "
                 f"(the 72 form, no recomputation)", head, "-" * (len(head) + 12)]
        for c in rows:
            rank = self.candidates.index(c) + 1
            r = c.record()
            lines.append(f"{rank:>3} {r['t']:>3}{r['p']:>4}{r['d']:>5}{r['b']:>3}{r['m']:>6}"
                         f"{r['v']:>3}" + (f"{r['recompute']:>11}" if mixed else "")
                         + f"{r['time_s']:>9.3f}{r['tflops_per_gpu']:>9.1f}"
                         f"{r['mfu']:>6.2f}{r['memory_gb']:>8.1f}  {r['flags']}")
        return "\n".join(lines)

    def plot(self, top: int = 12, ax=None, only_fitting: bool = False):
        """Stacked horizontal bars: seconds per iteration by cause for the ``top`` candidates in
        rank order (configurations that do not fit are hatched). Returns the matplotlib axes."""
        import matplotlib.pyplot as plt
        rows = (self.fitting() if only_fitting else self.candidates)[:top]
        if ax is None:
            _, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
        colors = dict(compute="#4c72b0", tp_comm="#dd8452", pp_p2p="#937860", bubble="#c44e52",
                      dp_comm="#55a868", optimizer="#8c8c8c")
        labels = [f"t={c.config.tp} p={c.config.pp} d={c.config.dp} b={c.config.b}"
                  + (f" v={c.config.v}" if c.config.v > 1 else "") for c in rows]
        for i, c in enumerate(rows):
            left = 0.0
            for key, secs in c.prediction.breakdown().items():
                ax.barh(i, secs, left=left, color=colors[key], hatch=None if c.fits else "//",
                        edgecolor="white", label=key if i == 0 else None)
                left += secs
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(labels)
        ax.invert_yaxis()
        ax.set_xlabel("predicted seconds per iteration (hatched: does not fit in memory)")
        ax.set_title(f"{self.model.name or 'model'}: {self.num_gpus} GPUs, "
                     f"batch {self.global_batch_size}, {self.cluster.name}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
        return ax

    def assumptions(self) -> str:
        """What this ranking takes for granted, read from its configurations, the cluster and
        :func:`predict_iteration`'s defaults, and what the cost model leaves out."""
        cfgs = [c.config for c in self.candidates]
        cl, model = self.cluster, self.model
        sp = ("on wherever t > 1" if all(c.sequence_parallel == (c.tp > 1) for c in cfgs)
              else _switch(cfgs, "sequence_parallel"))
        recompute = ", ".join(sorted({recompute_label(c) for c in cfgs}))
        vs = sorted({c.v for c in cfgs})
        overlaps = {name: _switch(cfgs, attr) for name, attr in (
            ("data-parallel gradient all-reduce", "overlap_grad_reduce"),
            ("tensor-parallel collectives", "overlap_tp_comm"),
            ("pipeline send/recv", "overlap_p2p_comm"))}
        terms = bytes_per_parameter_terms(self.params_dtype, self.grads_dtype)
        kept, split = sum(terms["replicated"].values()), sum(terms["sharded"].values())
        act_bits = 8 * terms["replicated"]["param"]
        lines = [
            f"The ranking of {len(cfgs)} configurations assumes:",
            f"- splits: t·p·d = {self.num_gpus}, t divides the {model.a} heads, p the {model.L} "
            f"layers; micro-batch b in {tuple(sorted({c.b for c in cfgs}))}; "
            f"v in {tuple(vs)}" + (" (plain 1F1B, no interleaving)" if vs == [1] else ""),
            f"- sequence parallelism: {sp}",
            f"- activation recomputation: {recompute}",
            f"- distributed optimizer: {_switch(cfgs, 'distributed_optimizer')}"
            + (" (every data-parallel rank keeps all the Adam states of its shard of the model)"
               if _switch(cfgs, "distributed_optimizer") == "off" else ""),
            *([f"- data-parallel sharding (Megatron-FSDP's names): "
               f"{', '.join(sorted({c.sharding for c in cfgs}))}"]
              if any(c.data_parallel_sharding_strategy for c in cfgs) else []),
            f"- flash attention: {_switch(cfgs, 'flash_attention')}",
            "- overlap: " + ", ".join(f"{k} {v}" for k, v in overlaps.items()),
            f"- {act_bits}-bit weights and activations ({self.params_dtype}), "
            f"{self.grads_dtype} gradients: {kept + split} bytes per parameter for weights, "
            f"gradients and Adam "
            f"({kept} + {split}/d with the distributed optimizer; Megatron-core's "
            f"distributed-optimizer guide)",
            f"- {cl.name}: {cl.peak_flops / 1e12:.0f} TFLOP/s peak per GPU, matmuls at "
            f"{cl.matmul_efficiency:.2f} of it; links {cl.intra_node_bandwidth / 1e9:.0f} GB/s "
            f"inside a node of {cl.gpus_per_node}, {cl.inter_node_bandwidth / 1e9:.0f} GB/s "
            f"between nodes (each way, per GPU) at {cl.bandwidth_efficiency:.2f} of it, "
            f"{cl.latency_s * 1e6:.0f} us per collective; {cl.memory_bytes / 1e9:.0f} GB per GPU",
            "- not modelled: " + "; ".join(not_modelled())]
        return fit("\n".join(lines))

    def ranking_under_error(self, error: float, trials: int = 2000, seed: int = 0) -> dict:
        """How much of the ranking survives a model error of up to ``±error`` (a share, e.g.
        0.11). Each trial scales every fitting configuration's predicted time by its own factor
        drawn uniformly from [1 - error, 1 + error] and notes which comes first: independent
        errors, the worst case for a ranking (an error shared by all configurations scales them
        together and changes nothing). Returns ``gap`` (#2 over #1, minus 1), ``contenders``
        (fitting configurations within (1 + error)/(1 - error) of #1, each of which some draw
        can put first) and ``first`` (rank → share of trials it came first), deterministic for
        a given ``seed``."""
        if not 0 <= error < 1:
            raise ValueError(f"error must be a share in [0, 1), e.g. 0.11 for 11 %, got {error!r}")
        if not isinstance(trials, int) or trials < 1:
            raise ValueError(f"trials must be a positive integer, got {trials!r}")
        fit = self.fitting()
        if not fit:
            raise ValueError(f"no configuration fits in {self.cluster.memory_bytes / 1e9:.0f} GB")
        times = [c.prediction.total_s for c in fit]
        rng = random.Random(seed)
        wins = [0] * len(fit)
        for _ in range(trials):
            drawn = [t * rng.uniform(1 - error, 1 + error) for t in times]
            wins[drawn.index(min(drawn))] += 1
        bound = times[0] * (1 + error) / (1 - error)
        return dict(error=error, trials=trials, fitting=len(fit),
                    gap=times[1] / times[0] - 1 if len(times) > 1 else float("inf"),
                    contenders=1 + sum(t < bound for t in times[1:]),
                    first={i + 1: w / trials for i, w in enumerate(wins) if w})

    def format_ranking_under_error(self, error: float, top: int = 6, **kwargs) -> str:
        """:meth:`ranking_under_error` in words and a table of the first ``top`` ranks."""
        r = self.ranking_under_error(error, **kwargs)
        lines = [f"Model error up to ±{error:.1%}, independent per configuration "
                 f"({r['trials']} draws):",
                 f"  #2 is {r['gap']:.1%} slower than #1; {r['contenders']} of {r['fitting']} "
                 f"fitting configurations lie within a factor {(1 + error) / (1 - error):.2f} "
                 f"of #1, and any of them can come first",
                 f"{'rank':>6}{'t':>4}{'p':>4}{'d':>5}{'b':>3}{'predicted s':>13}"
                 f"{'first in':>10}"]
        for i, c in enumerate(self.fitting()[:top]):
            lines.append(f"{i + 1:>6}{c.config.tp:>4}{c.config.pp:>4}{c.config.dp:>5}"
                         f"{c.config.b:>3}{c.prediction.total_s:>13.3f}"
                         f"{r['first'].get(i + 1, 0.0):>10.0%}")
        return fit("\n".join(lines))

    def explain(self, candidate: Candidate) -> str:
        """Why this candidate is where it is: its breakdown and its flags in words."""
        c, pr = candidate.config, candidate.prediction
        parts = ", ".join(f"{k} {v:.0%}" for k, v in pr.shares().items() if v >= 0.005)
        lines = [f"t={c.tp} p={c.pp} d={c.dp} b={c.b} m={c.m} v={c.v}: "
                 f"{pr.total_s:.3f} s per iteration, MFU {pr.mfu:.2f}, "
                 f"{pr.memory_gb:.1f} GB per GPU", f"  time: {parts}"]
        lines += [f"  - {r}" for r in candidate.reasons] or ["  - nothing flagged"]
        return fit("\n".join(lines))


def explore(model: ModelShape, cluster: Cluster, num_gpus: int, global_batch_size: int,
            micro_batch_sizes: Sequence[int] = (1, 2, 4, 8), virtual_stages: Sequence[int] = (1,),
            sequence_parallel: bool = True, recompute: str = "selective",
            thresholds: Optional[Dict[str, float]] = None, params_dtype="fp16",
            grads_dtype="fp16", **options) -> Exploration:
    """Enumerate (:func:`enumerate_configs`), predict, flag (:func:`diagnose`) and rank.

    ``params_dtype`` / ``grads_dtype`` (a torch dtype or a name, as
    :func:`~mpu_lab.perf.cost_model.bytes_per_parameter` takes them; default fp16/fp16, the
    mixed precision of Narayanan et al. 2021): the width of the weights, activations and
    gradients (the gradients' sets the data-parallel all-reduce's bytes) and Megatron's bytes
    per parameter for weights, gradients and Adam (20 for fp16/fp16, 18 for bf16/fp32, 16 for
    fp32/fp32), which decide what fits. ``recompute``: one of ``"none"``, ``"selective"``,
    ``"full"`` for every split, or ``"auto"``: for each split the fastest recomputation that
    fits (:func:`pick_recompute`, Megatron's block method included). Raises ValueError for bad
    inputs, for more GPUs than ``cluster.num_nodes`` provides, and when no configuration is
    valid (naming the constraint that rules them all out)."""
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_CHOICES}, got {recompute!r}")
    bytes_per_parameter(params_dtype, grads_dtype)            # a pair Megatron trains with
    terms = bytes_per_parameter_terms(params_dtype, grads_dtype)["replicated"]
    if cluster.num_gpus is not None and num_gpus > cluster.num_gpus:
        raise ValueError(f"num_gpus {num_gpus} is more than the cluster's {cluster.num_gpus} "
                         f"({cluster.num_nodes} nodes x {cluster.gpus_per_node})")
    auto = recompute == "auto"
    configs = enumerate_configs(model, num_gpus, global_batch_size, micro_batch_sizes,
                                virtual_stages, sequence_parallel,
                                "none" if auto else recompute, **options)
    if not configs:
        raise ValueError(
            f"no valid (t, p, d, b) for {num_gpus} GPUs and global batch {global_batch_size}: "
            f"t must divide {model.a} heads, p must divide {model.L} layers, t·p·d = "
            f"{num_gpus}, and B = {global_batch_size} must be a multiple of b·d for some b in "
            f"{tuple(micro_batch_sizes)}")
    cands = []
    for cfg in configs:
        if auto:
            pred = pick_recompute(model, cfg, cluster, terms["param"], terms["grad"])
        else:
            pred = predict_iteration(model, cfg, cluster, dtype_bytes=terms["param"],
                                     grad_bytes=terms["grad"])
        cands.append(Candidate(pred.config, pred, diagnose(pred, thresholds)))
    cands.sort(key=lambda c: (not c.fits, round(c.prediction.total_s, 9), c.config.tp,
                              c.config.pp, c.config.b, c.config.v))
    return Exploration(model, cluster, num_gpus, global_batch_size, cands,
                       canonical_dtype(params_dtype), canonical_dtype(grads_dtype))
