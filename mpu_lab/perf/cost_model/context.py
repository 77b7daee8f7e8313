"""Context parallelism (CP) in the cost model: activation memory, bytes per layer, overlap, time.

CP splits the sequence of every layer over ``cp`` ranks (Megatron-core's
``--context-parallel-size``; :mod:`mpu_lab.core.context_parallel` is the mirror). Each rank keeps
``s/cp`` tokens (Megatron's layout: chunks r and 2·cp−1−r of 2·cp, so causal work is even) and
sees the other ranks' keys and values through one of three exchanges:

* ``p2p`` — a ring (Liu et al. 2023, "Ring Attention with Blockwise Transformers",
  arXiv:2310.01889; TransformerEngine's ``cp_comm_type="p2p"``): every rank passes its K and V
  block to the next rank ``cp − 1`` times, and in the backward pass the K and V blocks go round
  again (the forward keeps only its own) while the dK and dV they accumulated travel back;
* ``a2a`` — DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509): all-to-all from sequence
  split to head split for q, k and v, and back for the output;
* ``allgather`` — K and V all-gathered, as in the Llama 3 paper's CP (Dubey et al. 2024, §3.3.2);
  the backward reduce-scatters dK and dV.

Activation memory (Korthikanti et al. 2022, §4, Table 2): every ``s·b·h`` term of a layer becomes
``(s/cp)·b·h``; the attention scores of one rank are its q-chunk against all keys,
``a·(s/cp)·s·b``, not ``a·(s/cp)²·b``. So Table 2's value at ``s`` divided by ``cp`` exactly.

A CP run is modelled as its dense twin — the same model at sequence ``s/cp`` with ``cp`` times
the sequences, data parallelism ``d·cp`` (Megatron reduces gradients, and the distributed
optimizer shards, over its ``dp-cp`` group) — plus what the twin misses: the attention core of
a q-chunk against the ``s − s/cp`` keys of the other ranks, the part of the ring that does not
hide behind it, the full attention scores and the position embedding of the whole sequence.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

from mpu_lab.perf.cost_model.activations import activation_memory_per_layer
from mpu_lab.perf.cost_model.counts import (in_flight_microbatches, memory_per_gpu,
                                            recomputed_share)
from mpu_lab.perf.cost_model.inputs import Cluster, ModelShape, ParallelConfig
from mpu_lab.perf.cost_model.predict import predict_iteration

__all__ = ["CP_COMM_TYPES", "check_context_parallel", "cp_activation_memory_per_layer",
           "cp_score_bytes", "cp_comm_bytes_per_layer", "ring_overlap", "dense_twin",
           "cp_memory_per_gpu", "ContextParallelPrediction", "predict_context_parallel",
           "rank_context_parallel"]

CP_COMM_TYPES = ("p2p", "a2a", "allgather")


def check_context_parallel(model: ModelShape, cfg: ParallelConfig, cp: int,
                           comm_type: str = "p2p") -> None:
    """Raise ValueError naming the numbers when ``cp`` cannot split ``model`` under ``cfg``:
    s must be divisible by 2·cp (Megatron's layout), ``a2a`` needs the heads divisible by t·cp."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive integer, got {cp!r}")
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"comm_type must be one of {CP_COMM_TYPES}, got {comm_type!r}")
    if cp > 1 and model.s % (2 * cp):
        raise ValueError(f"seq_length {model.s} is not divisible by 2*cp = {2 * cp} "
                         f"(Megatron's load-balanced layout cuts it into 2*cp chunks)")
    if cp > 1 and comm_type == "a2a" and model.a % (cfg.tp * cp):
        raise ValueError(f"a2a needs the {model.a} heads divisible by t*cp = {cfg.tp * cp}")


def cp_activation_memory_per_layer(s: int, b: int, h: int, a: int, t: int = 1,
                                   sp: bool = False, cp: int = 1) -> float:
    """Bytes of activations one layer stores on one rank under CP (Korthikanti et al. 2022,
    Table 2 with ``s → s/cp`` in the ``s·b·h`` terms): Table 2 at ``s/cp`` — whose score term is
    a q-chunk against a k-chunk, ``5·a·(s/cp)²·b/t`` — plus the scores against the other
    ranks' keys, ``5·a·(s/cp)·(s − s/cp)·b/t``. Equals ``activation_memory_per_layer(s)/cp``."""
    if cp < 1 or s % cp:
        raise ValueError(f"cp must be >= 1 and divide seq_length {s}, got cp = {cp}")
    chunk = s // cp
    return (activation_memory_per_layer(chunk, b, h, a, t, sp)
            + 5 * a * chunk * (s - chunk) * b / t)


def cp_score_bytes(model: ModelShape, cfg: ParallelConfig, cp: int) -> float:
    """The attention-score part (softmax, its dropout and mask) of one rank's q-chunk against all
    keys: ``5·a·(s/cp)·s·b/t`` bytes (what flash attention and selective recomputation drop)."""
    return 5 * model.a * (model.s / cp) * model.s * cfg.b / cfg.tp


def cp_comm_bytes_per_layer(s: int, b: int, h: int, cp: int, comm_type: str = "p2p",
                            dtype_bytes: int = 2, t: int = 1) -> Dict[str, float]:
    """Bytes one rank sends in one layer's attention, forward and backward, for one micro-batch.

    With ``B`` = dtype_bytes and the heads split ``t`` ways (one K or V block is
    ``(s/cp)·b·h/t`` values):

    ==============  =============================  ====================================
    ``comm_type``   forward                        backward
    ==============  =============================  ====================================
    ``p2p``         ``2·(cp−1)·(s/cp)·b·h·B/t``    ``4·(cp−1)·(s/cp)·b·h·B/t`` (K, V
                    (K and V, cp−1 ring steps)     again, and dK, dV travelling back)
    ``a2a``         ``4·(cp−1)/cp·(s/cp)·b·h·B/t`` same (q, k, v to heads, output back;
                                                   the gradients the same way)
    ``allgather``   ``2·(cp−1)·(s/cp)·b·h·B/t``    ``2·(cp−1)·(s/cp)·b·h·B/t`` (reduce-
                                                   scatter of dK, dV)
    ==============  =============================  ====================================

    Grouped-query attention (fewer K/V heads) would shrink the K and V terms; ModelShape has
    none, so full heads are counted.
    """
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"comm_type must be one of {CP_COMM_TYPES}, got {comm_type!r}")
    if cp < 1 or s % cp:
        raise ValueError(f"cp must be >= 1 and divide seq_length {s}, got cp = {cp}")
    block = s / cp * b * h * dtype_bytes / t
    if comm_type == "p2p":
        fwd, bwd = 2 * (cp - 1) * block, 4 * (cp - 1) * block
    elif comm_type == "a2a":
        fwd = bwd = 4 * (cp - 1) / cp * block
    else:
        fwd = bwd = 2 * (cp - 1) * block
    return dict(forward=float(fwd), backward=float(bwd), total=float(fwd + bwd))


def ring_overlap(s: int, b: int, h: int, cp: int, cluster: Cluster, crosses_nodes: bool,
                 dtype_bytes: int = 2, t: int = 1) -> Dict[str, float]:
    """Does one p2p ring step hide behind attention? Compares, per ring step of the forward
    pass, the compute of one block pair — ``4·(s/cp)²·b·h/t`` FLOPs for QKᵀ and the weighted
    sum, of which the causal mask leaves half in Megatron's layout (two of the four sub-blocks
    after the first step) — at ``peak·matmul_efficiency``, against the transfer of one K and V
    block, ``2·(s/cp)·b·h·B/t`` bytes, at the link's ``bandwidth·bandwidth_efficiency``. The
    backward does twice both, so the ratio holds there too. ``hidden`` when compute ≥ transfer,
    i.e. ``s/cp ≥ rate·B/bandwidth`` (``min_tokens_per_rank``)."""
    chunk = s / cp
    rate = cluster.peak_flops * cluster.matmul_efficiency
    link = (cluster.inter_node_bandwidth if crosses_nodes else cluster.intra_node_bandwidth) \
        * cluster.bandwidth_efficiency
    compute = 0.5 * 4 * chunk * chunk * b * h / t / rate
    transfer = 2 * chunk * b * h * dtype_bytes / t / link
    return dict(compute_s=compute, transfer_s=transfer, hidden=compute >= transfer,
                exposed_s=max(0.0, transfer - compute),
                min_tokens_per_rank=rate * dtype_bytes / link)


def dense_twin(model: ModelShape, cfg: ParallelConfig, cp: int):
    """The dense run a CP run resembles: sequence ``s/cp``, ``cp`` times the sequences, data
    parallelism ``d·cp`` (Megatron's ``dp-cp`` group). Returns ``(model, cfg)``."""
    twin_model = dataclasses.replace(model, seq_length=model.s // cp,
                                     name=f"{model.name} s/{cp}" if model.name else "")
    twin_cfg = dataclasses.replace(cfg, dp=cfg.dp * cp,
                                   global_batch_size=cfg.global_batch_size * cp)
    return twin_model, twin_cfg


def cp_memory_per_gpu(model: ModelShape, cfg: ParallelConfig, cp: int, dtype_bytes: int = 2,
                      grad_bytes=None) -> Dict[str, float]:
    """:func:`~mpu_lab.perf.cost_model.counts.memory_per_gpu` under CP: the same weights,
    gradients and optimizer states (the distributed optimizer shards over d·cp), activations
    per :func:`cp_activation_memory_per_layer` with the recomputation and flash switches as
    for the dense model. ``cp = 1`` gives memory_per_gpu's numbers exactly."""
    _, twin_cfg = dense_twin(model, cfg, cp)
    out = memory_per_gpu(model, twin_cfg, dtype_bytes, grad_bytes)
    if cp == 1:
        return out
    full = cp_activation_memory_per_layer(model.s, cfg.b, model.h, model.a, cfg.tp,
                                          cfg.sequence_parallel, cp)
    no_scores = full - cp_score_bytes(model, cfg, cp)
    chunk = model.s / cp
    whole = no_scores if cfg.flash_attention or cfg.recompute == "selective" else full
    stored, share = whole, recomputed_share(model, cfg)
    if cfg.recompute == "full":        # the block method: only a share of the layers recompute
        layer_input = 2 * chunk * cfg.b * model.h / (cfg.tp if cfg.sequence_parallel else 1)
        stored = share * layer_input + (1 - share) * whole
    scale = dtype_bytes / 2
    act = stored * model.L / cfg.pp * in_flight_microbatches(cfg) * scale
    if share == 1:                     # every layer recomputed: one layer's whole set live again
        act += whole * scale
    out = dict(out, activations=act)
    out["total"] = out["weights"] + out["gradients"] + out["optimizer"] + act
    return out


@dataclasses.dataclass(frozen=True)
class ContextParallelPrediction:
    """One (t, p, d, cp) prediction: seconds per iteration, memory per GPU, the ring's verdict.

    ``extra_attention_s``: the q-chunks against the other ranks' keys; ``ring_exposed_s``: the
    exchange on the critical path; ``ring_hidden``: for p2p whether one ring step hides behind
    its block pair (:func:`ring_overlap`); a2a and allgather are not overlapped (False)."""
    model: ModelShape
    config: ParallelConfig
    cp: int
    cluster: Cluster
    total_s: float
    extra_attention_s: float
    ring_exposed_s: float
    ring_hidden: bool
    memory: Dict[str, float]

    @property
    def num_gpus(self) -> int:
        return self.config.num_gpus * self.cp

    @property
    def memory_gb(self) -> float:
        return self.memory["total"] / 1e9

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.cluster.memory_bytes


def predict_context_parallel(model: ModelShape, cfg: ParallelConfig, cp: int, cluster: Cluster,
                             comm_type: str = "p2p", dtype_bytes: int = 2,
                             grad_bytes: Optional[int] = None) -> ContextParallelPrediction:
    """Predict one iteration with CP: the dense twin's :func:`predict_iteration` plus, for
    each of the (m + p − 1) micro-batch slots of the pipeline and each of the L/p layers, the
    attention of the q-chunk against the other ranks' keys (forward, backward = 2×, and the
    selective recomputation's forward) and the exposed part of the exchange. p2p overlaps
    step by step (:func:`ring_overlap`); a2a and allgather are counted on the critical path.
    ``cfg`` holds t, p, d (without cp) and the global batch in sequences of length s;
    ``grad_bytes`` defaults to ``dtype_bytes``. The memory-bound passes are the twin's, whose
    scores are a q-chunk against a k-chunk: without flash attention that undercounts the HBM
    traffic of the softmax by a factor cp."""
    check_context_parallel(model, cfg, cp, comm_type)
    cfg.check(model)
    grad_bytes = dtype_bytes if grad_bytes is None else grad_bytes
    twin_model, twin_cfg = dense_twin(model, cfg, cp)
    base = predict_iteration(twin_model, twin_cfg, cluster, dtype_bytes, grad_bytes)
    chunk = model.s // cp
    tokens_mb = cfg.b * chunk
    passes = 3 + (1 if cfg.recompute == "selective" else recomputed_share(model, cfg))
    extra_flops = tokens_mb * passes * 4 * model.h * (model.s - chunk) / cfg.tp
    rate = cluster.peak_flops * cluster.matmul_efficiency
    crosses = cp > 1 and cfg.tp * cp > cluster.gpus_per_node
    if comm_type == "p2p":
        ring = ring_overlap(model.s, cfg.b, model.h, cp, cluster, crosses, dtype_bytes, cfg.tp)
        exposed, hidden = 3 * (cp - 1) * ring["exposed_s"], ring["hidden"]
    else:
        link = (cluster.inter_node_bandwidth if crosses else cluster.intra_node_bandwidth) \
            * cluster.bandwidth_efficiency
        nbytes = cp_comm_bytes_per_layer(model.s, cfg.b, model.h, cp, comm_type, dtype_bytes,
                                         cfg.tp)["total"]
        exposed, hidden = nbytes / link, cp == 1
    slots = cfg.m + (cfg.pp - 1) / cfg.v
    layers = model.L / cfg.pp
    extra_s = slots * layers * extra_flops / rate
    ring_s = slots * layers * exposed
    memory = cp_memory_per_gpu(model, cfg, cp, dtype_bytes, grad_bytes)
    return ContextParallelPrediction(model, cfg, cp, cluster, base.total_s + extra_s + ring_s,
                                     extra_s, ring_s, hidden, memory)



def rank_context_parallel(model: ModelShape, cluster: Cluster, num_gpus: int,
                          global_batch_size: int, cps=(1, 2, 4, 8), max_tp=None,
                          comm_type: str = "p2p", micro_batch_size: int = 1,
                          recompute: str = "selective", distributed_optimizer: bool = True):
    """Every valid (t, p, d, cp) with t·p·d·cp = ``num_gpus``, predicted and ranked: fitting
    ones first, then by seconds per iteration (ties by t, p, cp). ``max_tp`` (default: the
    node's GPUs) keeps TP inside a node; sequence parallelism is on wherever t > 1. Raises
    ValueError when no configuration is valid."""
    max_tp = cluster.gpus_per_node if max_tp is None else max_tp
    out = []
    for cp in cps:
        if num_gpus % cp:
            continue
        rest = num_gpus // cp
        for t in (x for x in range(1, rest + 1) if rest % x == 0 and x <= max_tp):
            for p in (x for x in range(1, rest // t + 1) if (rest // t) % x == 0):
                cfg = ParallelConfig(tp=t, pp=p, dp=rest // (t * p),
                                     micro_batch_size=micro_batch_size,
                                     global_batch_size=global_batch_size,
                                     sequence_parallel=t > 1, recompute=recompute,
                                     distributed_optimizer=distributed_optimizer)
                if cfg.problems(model):
                    continue
                try:
                    check_context_parallel(model, cfg, cp, comm_type)
                except ValueError:
                    continue
                out.append(predict_context_parallel(model, cfg, cp, cluster, comm_type))
    if not out:
        raise ValueError(f"no valid (t, p, d, cp) for {num_gpus} GPUs, batch "
                         f"{global_batch_size}, cp in {tuple(cps)}, t <= {max_tp}")
    out.sort(key=lambda r: (not r.fits, round(r.total_s, 9), r.config.tp, r.config.pp, r.cp))
    return out
