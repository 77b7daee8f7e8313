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
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

from mpu_lab.perf.cost_model import (Cluster, IterationPrediction, ModelShape, ParallelConfig,
                                     RECOMPUTE_MODES, bubble_fraction, group_crosses_nodes,
                                     predict_iteration)
from mpu_lab.utils import divisors

__all__ = ["Candidate", "Exploration", "enumerate_configs", "explore", "diagnose",
           "DEFAULT_THRESHOLDS"]

# When a share of the iteration counts as "bad" (plain-language flags).
DEFAULT_THRESHOLDS = dict(bubble=0.15, tp_comm=0.15, dp_comm=0.10, pp_p2p=0.05,
                          memory_headroom=0.0)


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
        head = (f"{'#':>3} {'t':>3}{'p':>4}{'d':>5}{'b':>3}{'m':>6}{'v':>3}{'time s':>9}"
                f"{'TFLOP/s':>9}{'MFU':>6}{'mem GB':>8}  flags")
        lines = [f"{self.model.name or 'model'} on {self.num_gpus} GPUs ({self.cluster.name}), "
                 f"global batch {self.global_batch_size}", head, "-" * (len(head) + 12)]
        for c in rows:
            rank = self.candidates.index(c) + 1
            r = c.record()
            lines.append(f"{rank:>3} {r['t']:>3}{r['p']:>4}{r['d']:>5}{r['b']:>3}{r['m']:>6}"
                         f"{r['v']:>3}{r['time_s']:>9.3f}{r['tflops_per_gpu']:>9.1f}"
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

    def explain(self, candidate: Candidate) -> str:
        """Why this candidate is where it is: its breakdown and its flags in words."""
        c, pr = candidate.config, candidate.prediction
        parts = ", ".join(f"{k} {v:.0%}" for k, v in pr.shares().items() if v >= 0.005)
        lines = [f"t={c.tp} p={c.pp} d={c.dp} b={c.b} m={c.m} v={c.v}: "
                 f"{pr.total_s:.3f} s per iteration, MFU {pr.mfu:.2f}, "
                 f"{pr.memory_gb:.1f} GB per GPU", f"  time: {parts}"]
        lines += [f"  - {r}" for r in candidate.reasons] or ["  - nothing flagged"]
        return "\n".join(lines)


def explore(model: ModelShape, cluster: Cluster, num_gpus: int, global_batch_size: int,
            micro_batch_sizes: Sequence[int] = (1, 2, 4, 8), virtual_stages: Sequence[int] = (1,),
            sequence_parallel: bool = True, recompute: str = "selective",
            thresholds: Optional[Dict[str, float]] = None, **options) -> Exploration:
    """Enumerate (:func:`enumerate_configs`), predict, flag (:func:`diagnose`) and rank.

    Raises ValueError for bad inputs, for more GPUs than ``cluster.num_nodes`` provides, and
    when no configuration is valid (naming the constraint that rules them all out)."""
    if cluster.num_gpus is not None and num_gpus > cluster.num_gpus:
        raise ValueError(f"num_gpus {num_gpus} is more than the cluster's {cluster.num_gpus} "
                         f"({cluster.num_nodes} nodes x {cluster.gpus_per_node})")
    configs = enumerate_configs(model, num_gpus, global_batch_size, micro_batch_sizes,
                                virtual_stages, sequence_parallel, recompute, **options)
    if not configs:
        raise ValueError(
            f"no valid (t, p, d, b) for {num_gpus} GPUs and global batch {global_batch_size}: "
            f"t must divide {model.a} heads, p must divide {model.L} layers, t·p·d = "
            f"{num_gpus}, and B = {global_batch_size} must be a multiple of b·d for some b in "
            f"{tuple(micro_batch_sizes)}")
    cands = []
    for cfg in configs:
        pred = predict_iteration(model, cfg, cluster)
        cands.append(Candidate(cfg, pred, diagnose(pred, thresholds)))
    cands.sort(key=lambda c: (not c.fits, round(c.prediction.total_s, 9), c.config.tp,
                              c.config.pp, c.config.b, c.config.v))
    return Exploration(model, cluster, num_gpus, global_batch_size, cands)
