"""Mixture of experts (MoE) and expert parallelism (EP) in the cost model.

An MoE layer replaces the dense MLP by ``E`` expert MLPs and a router ``h × E`` that sends each
token to its top ``k`` (Shazeer et al. 2017; GShard, Lepikhin et al. 2020, arXiv:2006.16668;
Switch Transformers, Fedus et al. 2021, arXiv:2101.03961). So the experts count ``E`` times in
the parameters and ``k`` times in the FLOPs per token. Expert parallelism places ``E/ep``
experts on each rank (Megatron-core's ``--expert-model-parallel-size``; :mod:`mpu_lab.core.transformer.moe`
is the mirror) and moves tokens with an all-to-all before the experts (dispatch) and after
them (combine), in both passes.

:class:`MoEModelShape` describes such a GPT, with grouped-query attention (``kv_heads``), a
gated MLP (SwiGLU: three ``h × ffn`` matrices per expert), untied input and output embeddings
and rotary positions (no position embedding) as options — the shape of Mixtral 8x7B
(Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088: 32 layers, h 4096, ffn 14336,
32 heads, 8 KV heads, 8 experts, top 2, vocabulary 32000). :data:`MIXTRAL_8X7B` is it; Mistral
AI's announcement ("Mixtral of experts", 11 Dec 2023) gives 46.7 B parameters in total and
12.9 B used per token, which :func:`moe_parameter_count` reproduces within 0.5 % (it leaves
out nothing Mixtral has but rounding: no biases, RMSNorm weights only).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

from mpu_lab.perf.cost_model.activations import activation_memory_per_layer
from mpu_lab.perf.cost_model.counts import (in_flight_microbatches, recomputed_share,
                                            ring_all_reduce_factor)
from mpu_lab.perf.cost_model.inputs import Cluster, ModelShape, ParallelConfig
from mpu_lab.perf.cost_model.optimizer_state import bytes_per_parameter_terms, dtype_for_bytes
from mpu_lab.perf.cost_model.predict import ADAM_STEP_BYTES_PER_PARAM, predict_iteration

__all__ = ["MoEModelShape", "MIXTRAL_8X7B", "moe_parameter_count", "moe_flops_per_token",
           "moe_a2a_bytes_per_layer", "moe_memory_per_gpu", "MoEPrediction", "predict_moe",
           "rank_expert_parallel"]


@dataclasses.dataclass(frozen=True)
class MoEModelShape:
    """A GPT whose MLPs are MoE layers: the dense shape (L, h, a, s, V, ffn per expert), the
    experts ``num_experts`` (E) and ``top_k`` (k), and the options of a modern shape."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int
    num_experts: int
    top_k: int
    kv_heads: Optional[int] = None          # grouped-query attention; None: a (full heads)
    gated_mlp: bool = True                  # SwiGLU: fc1 is two h×ffn matrices
    tied_embeddings: bool = False
    position_embedding: bool = False        # False: rotary, no parameters
    name: str = ""

    def __post_init__(self):
        for field in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                      "vocab_size", "ffn_hidden_size", "num_experts", "top_k"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEModelShape.{field} must be a positive integer, "
                                 f"got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} is more than num_experts {self.num_experts}")
        if self.num_attention_heads % self.kv:
            raise ValueError(f"kv_heads {self.kv} does not divide the "
                             f"{self.num_attention_heads} heads")

    L = property(lambda self: self.num_layers)
    h = property(lambda self: self.hidden_size)
    a = property(lambda self: self.num_attention_heads)
    s = property(lambda self: self.seq_length)
    V = property(lambda self: self.vocab_size)
    ffn = property(lambda self: self.ffn_hidden_size)
    E = property(lambda self: self.num_experts)
    k = property(lambda self: self.top_k)
    kv = property(lambda self: self.kv_heads or self.num_attention_heads)

    def dense_twin(self) -> ModelShape:
        """The dense GPT that does the same matmul work per token: one MLP of ``k`` experts'
        width (×3/2 when gated, as the cost model's MLP has two matrices)."""
        width = self.k * self.ffn * (3 if self.gated_mlp else 2) // 2
        return ModelShape(num_layers=self.L, hidden_size=self.h, num_attention_heads=self.a,
                          seq_length=self.s, vocab_size=self.V, ffn_hidden_size=width,
                          name=f"{self.name} (active)" if self.name else "")


# Jiang et al. 2024, Table 1 (arXiv:2401.04088).
MIXTRAL_8X7B = MoEModelShape(num_layers=32, hidden_size=4096, num_attention_heads=32,
                             seq_length=4096, vocab_size=32000, ffn_hidden_size=14336,
                             num_experts=8, top_k=2, kv_heads=8, name="Mixtral 8x7B")


def moe_parameter_count(model: MoEModelShape) -> Dict[str, float]:
    """Parameters by part (no biases; norms are one weight vector each).

    Per layer: attention ``2h² + 2h·(h·kv/a)`` (q and output h×h, k and v h×(h·kv/a)); each
    expert ``(3 if gated else 2)·h·ffn``; the router ``h·E``; two norms ``2h``. Plus the
    embedding ``V·h`` (twice when untied), a position embedding ``s·h`` if learned, the final
    norm ``h``. ``total`` counts all E experts; ``active`` the k a token uses (Fedus et al. 2021
    §2). Also ``experts`` (all layers' experts) and ``dense`` (everything else).
    """
    h = model.h
    attention = 2 * h * h + 2 * h * (h * model.kv // model.a)
    expert = (3 if model.gated_mlp else 2) * h * model.ffn
    router, norms = h * model.E, 2 * h
    embeddings = model.V * h * (1 if model.tied_embeddings else 2) + h \
        + (model.s * h if model.position_embedding else 0)
    dense = model.L * (attention + router + norms) + embeddings
    experts = model.L * model.E * expert
    return dict(attention_per_layer=float(attention), expert=float(expert),
                router_per_layer=float(router), embeddings=float(embeddings),
                dense=float(dense), experts=float(experts), total=float(dense + experts),
                active=float(dense + model.L * model.k * expert))


def moe_flops_per_token(model: MoEModelShape) -> Dict[str, float]:
    """Forward matmul FLOPs per token: 2 per weight a token meets — attention projections,
    ``k`` experts, the router ``2hE`` — plus the attention core ``4sh`` (QKᵀ and the weighted
    sum over all ``a`` query heads; GQA shares K and V but does not shrink it) and the logits
    ``2hV``. Forward + backward is 3× (Narayanan et al. 2021)."""
    n = moe_parameter_count(model)
    layer = 2 * (n["attention_per_layer"] + model.k * n["expert"] + n["router_per_layer"]) \
        + 4 * model.s * model.h
    return dict(layer=float(layer), logits=2.0 * model.h * model.V,
                total=float(model.L * layer + 2 * model.h * model.V))


def moe_a2a_bytes_per_layer(tokens: int, h: int, k: int, ep: int, dtype_bytes: int = 2
                            ) -> Dict[str, float]:
    """Bytes one rank sends in one MoE layer's all-to-alls (the ``alltoall`` dispatcher), for
    ``tokens`` tokens on that rank: each of dispatch and combine moves ``tokens·k·h·B·(ep−1)/ep``
    (every token goes to k experts, a share (ep−1)/ep of them on other ranks under balanced
    routing), in the forward pass and again in the backward: 4 such all-to-alls in all."""
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    one = tokens * k * h * dtype_bytes * (ep - 1) / ep
    return dict(dispatch=float(one), combine=float(one), forward=float(2 * one),
                backward=float(2 * one), total=float(4 * one))


def _check(model: MoEModelShape, cfg: ParallelConfig, ep: int) -> None:
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be a positive integer, got {ep!r}")
    if model.E % ep:
        raise ValueError(f"ep {ep} does not divide num_experts {model.E}")
    if (cfg.tp * cfg.dp) % ep:
        raise ValueError(f"ep {ep} does not divide t*d = {cfg.tp * cfg.dp} (the world "
                         f"{cfg.num_gpus} must be divisible by etp*ep*pp with etp = 1)")
    if model.kv % cfg.tp and cfg.tp % model.kv:
        raise ValueError(f"tp {cfg.tp} and kv_heads {model.kv}: one must divide the other")
    cfg.check(model.dense_twin())


def _dense_first_stage(model: MoEModelShape, cfg: ParallelConfig, n: Dict[str, float]) -> float:
    # attention, router and norms of L/p layers, the word embedding, and with p = 1 and untied
    # embeddings the output layer too; all split t ways (the final norm is left out)
    layers = model.L / cfg.pp
    tables = 2 if (cfg.pp == 1 and not model.tied_embeddings) else 1
    return (layers * (n["attention_per_layer"] + n["router_per_layer"] + 2 * model.h)
            + tables * model.V * model.h) / cfg.tp


def moe_memory_per_gpu(model: MoEModelShape, cfg: ParallelConfig, ep: int,
                       dtype_bytes: int = 2, grad_bytes: Optional[int] = None
                       ) -> Dict[str, float]:
    """Bytes on the first pipeline stage, by kind, with expert parallelism ``ep`` (etp = 1).

    Dense parameters (attention, router, norms; the embedding on the first stage, and the output
    layer too when p = 1 and untied) are split t ways as today; the experts of its L/p layers ``ep`` ways. Weights and gradients use
    Megatron's bytes per parameter (:mod:`~mpu_lab.perf.cost_model.optimizer_state`); the
    optimizer states are sharded with the distributed optimizer over d for dense parameters and
    over the expert data-parallel group ``t·d/ep`` for experts. Activations: Korthikanti et al.
    2022 Table 2 (without the scores under selective recomputation or flash attention; only
    each layer's input, plus one layer live, under full recomputation), with the
    MLP's inner terms (4·ffn bytes per token) replaced by k experts' (6·ffn when gated: fc1's
    two halves and the product), split t ways with sequence parallelism.
    """
    grad_bytes = dtype_bytes if grad_bytes is None else grad_bytes
    terms = bytes_per_parameter_terms(dtype_for_bytes(dtype_bytes, "dtype_bytes"),
                                      dtype_for_bytes(grad_bytes, "grad_bytes"))
    n = moe_parameter_count(model)
    layers = model.L / cfg.pp
    dense = _dense_first_stage(model, cfg, n)
    experts = layers * model.E * n["expert"] / ep
    shard = sum(terms["sharded"].values())
    edp = cfg.tp * cfg.dp // ep
    optimizer = shard * (dense / (cfg.dp if cfg.distributed_optimizer else 1)
                         + experts / (edp if cfg.distributed_optimizer else 1))
    s, b, h, t = model.s, cfg.b, model.h, cfg.tp
    table2 = activation_memory_per_layer(s, b, h, model.a, t, cfg.sequence_parallel)
    no_scores = table2 - 5 * model.a * s * s * b / t
    mlp_dense = 4 * s * b * 4 * h / t                   # GeLU input + fc2 input, 16-bit
    mlp_moe = model.k * (6 if model.gated_mlp else 4) * s * b * model.ffn / t
    layer = no_scores - mlp_dense + mlp_moe
    if cfg.recompute == "none" and not cfg.flash_attention:
        layer += table2 - no_scores                     # the scores are kept too
    stored, share = layer, recomputed_share(model, cfg)
    if cfg.recompute == "full":       # a recomputed layer keeps only its input; with the block
        kept = layer + (0 if cfg.flash_attention else table2 - no_scores)   # method the rest
        stored = share * 2 * s * b * h / (t if cfg.sequence_parallel else 1) + (1 - share) * kept
    act = stored * layers * in_flight_microbatches(cfg) * dtype_bytes / 2
    if share == 1:
        act += layer * dtype_bytes / 2                  # one layer recomputed at a time
    weights = terms["replicated"]["param"] * (dense + experts)
    grads = terms["replicated"]["grad"] * (dense + experts)
    return dict(weights=weights, gradients=grads, optimizer=optimizer, activations=act,
                total=weights + grads + optimizer + act)


@dataclasses.dataclass(frozen=True)
class MoEPrediction:
    """One (t, p, d, ep) prediction: seconds per iteration, its all-to-all part, memory."""
    model: MoEModelShape
    config: ParallelConfig
    ep: int
    cluster: Cluster
    total_s: float
    a2a_s: float
    memory: Dict[str, float]

    @property
    def memory_gb(self) -> float:
        return self.memory["total"] / 1e9

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.cluster.memory_bytes


def predict_moe(model: MoEModelShape, cfg: ParallelConfig, ep: int, cluster: Cluster,
                dtype_bytes: int = 2, grad_bytes: int = 2) -> MoEPrediction:
    """Seconds per iteration with EP: the dense twin (:meth:`MoEModelShape.dense_twin`, the
    same FLOPs per token) through :func:`predict_iteration` for compute, TP, pipeline and
    bubble, with the twin's data-parallel and optimizer terms replaced by the MoE's (dense
    gradients all-reduced over d, each rank's E/ep experts over t·d/ep; the Adam step over the
    rank's own parameters; over the network once the world spans nodes, a coarse rule), plus
    the all-to-alls of every layer on the critical path (no overlap), for the (m + p − 1)
    micro-batch slots. The ep group is consecutive ranks (etp = 1, Megatron's expert order), so
    it crosses nodes when ep > GPUs per node. The twin has no grouped-query attention: its K
    and V projections count full heads (for Mixtral 2·(2h² − 2h²·kv/a) = 50 M FLOPs per token
    and layer too many, about 6 % of the 855 M of :func:`moe_flops_per_token`)."""
    _check(model, cfg, ep)
    base = predict_iteration(model.dense_twin(), cfg, cluster, dtype_bytes, grad_bytes,
                             ignore=("dp_comm", "optimizer"))
    tokens = cfg.b * model.s / (cfg.tp if cfg.sequence_parallel else 1)
    link = (cluster.inter_node_bandwidth if ep > cluster.gpus_per_node
            else cluster.intra_node_bandwidth) * cluster.bandwidth_efficiency
    a2a_layer = 4 * cluster.latency_s * (ep > 1) + \
        moe_a2a_bytes_per_layer(tokens, model.h, model.k, ep, dtype_bytes)["total"] / link
    slots = cfg.m + (cfg.pp - 1) / cfg.v
    a2a = slots * model.L / cfg.pp * a2a_layer
    n = moe_parameter_count(model)
    layers = model.L / cfg.pp
    dense = _dense_first_stage(model, cfg, n)
    experts = layers * model.E * n["expert"] / ep
    edp = cfg.tp * cfg.dp // ep
    dp_link = cluster.inter_node_bandwidth if cfg.num_gpus > cluster.gpus_per_node \
        else cluster.intra_node_bandwidth
    dp_s = (ring_all_reduce_factor(cfg.dp) * dense + ring_all_reduce_factor(edp) * experts) \
        * grad_bytes / (dp_link * cluster.bandwidth_efficiency)
    owned = (dense / cfg.dp + experts / edp) if cfg.distributed_optimizer else dense + experts
    optimizer_s = owned * ADAM_STEP_BYTES_PER_PARAM / cluster.hbm_bandwidth
    memory = moe_memory_per_gpu(model, cfg, ep, dtype_bytes, grad_bytes)
    return MoEPrediction(model, cfg, ep, cluster, base.total_s + a2a + dp_s + optimizer_s,
                         a2a, memory)


def rank_expert_parallel(model: MoEModelShape, cluster: Cluster, num_gpus: int,
                         global_batch_size: int, max_tp=None, micro_batch_size: int = 1,
                         recompute: str = "selective", distributed_optimizer: bool = True):
    """Every valid (t, p, d, ep) on ``num_gpus`` GPUs (t inside a node, ep dividing E and t·d),
    predicted with :func:`predict_moe` and ranked: fitting first, then by time."""
    max_tp = cluster.gpus_per_node if max_tp is None else max_tp
    out = []
    for t in (x for x in range(1, max_tp + 1) if num_gpus % x == 0):
        rest = num_gpus // t
        for p in (x for x in range(1, rest + 1) if rest % x == 0):
            cfg = ParallelConfig(tp=t, pp=p, dp=rest // p, micro_batch_size=micro_batch_size,
                                 global_batch_size=global_batch_size, sequence_parallel=t > 1,
                                 recompute=recompute,
                                 distributed_optimizer=distributed_optimizer)
            for ep in (x for x in range(1, model.E + 1) if model.E % x == 0):
                try:
                    out.append(predict_moe(model, cfg, ep, cluster))
                except ValueError:
                    continue
    if not out:
        raise ValueError(f"no valid (t, p, d, ep) for {num_gpus} GPUs and batch "
                         f"{global_batch_size}")
    out.sort(key=lambda r: (not r.fits, round(r.total_s, 9), r.config.tp, r.config.pp, r.ep))
    return out
