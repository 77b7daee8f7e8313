"""Closed-form counts of the cost model: parameters, FLOPs, pipeline bubble, bytes moved, memory.

Each function's docstring names its source:

* Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (arXiv:2104.04473): parameter count (§5.1) and FLOPs — the paper's Appendix
  derives the ``96 B s L h²`` form with full recomputation (eq. (3)); without the recomputed
  forward pass it is the ``72 B s L h²`` form (:data:`FLOP_FORMS`) —, pipeline bubble (§2.2),
  tensor-parallel communication (§3.2), scatter/gather of pipeline messages (§4.1).
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198): activation memory per layer (§4, Table 2;
  :mod:`mpu_lab.perf.cost_model.activations`), in-flight micro-batches of 1F1B and interleaved
  schedules (§4.2.3), selective recomputation (§5), model vs hardware FLOPs (MFU, HFU, §6).
* Megatron-core's developer guide, "Distributed Optimizer": bytes per parameter of its
  mixed-precision Adam (:mod:`mpu_lab.perf.cost_model.optimizer_state`); ZeRO's 16 (Rajbhandari
  et al. 2020 §3.1) is kept as :data:`BYTES_PER_PARAM_ADAM` for comparison only.
* Patarasuk & Yuan 2009 / NCCL's performance notes: a ring all-reduce moves 2(n-1)/n of the
  message through every GPU's link.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Dict, Optional

from mpu_lab.perf.cost_model.activations import activation_memory_per_layer
from mpu_lab.perf.cost_model.inputs import RECOMPUTE_MODES, ModelShape, ParallelConfig
from mpu_lab.perf.cost_model.optimizer_state import bytes_per_parameter_terms, dtype_for_bytes

__all__ = ["BYTES_PER_PARAM_ADAM", "parameter_count", "parameters_per_gpu", "flops_per_token",
           "model_flops_per_iteration", "hardware_flops_per_iteration", "FLOP_FORMS",
           "paper_flops_per_iteration", "format_flop_counts", "bubble_fraction",
           "ring_all_reduce_factor", "tp_comm_per_layer", "pipeline_p2p_bytes",
           "dp_allreduce_bytes", "in_flight_microbatches", "memory_per_gpu",
           "layer_activation_bytes", "score_bytes", "recomputed_share"]

# ZeRO §3.1's model of mixed precision (fp16 weight 2 + fp16 grad 2 + fp32 copy, m, v 12): not
# what Megatron allocates (no fp32 main grad); the cost model counts bytes_per_parameter's.
BYTES_PER_PARAM_ADAM = 16


def parameter_count(model: ModelShape) -> int:
    """Parameters of a GPT (Narayanan et al. 2021 §5.1):
    ``P = 12 L h² (1 + 13/(12h) + (V + s)/(12 L h))``.

    Per layer: QKV and output projections 4h² + 4h, the MLP 2·h·ffn + ffn + h, two layer norms
    4h (= 12h² + 13h for ffn = 4h); plus word and position embeddings (V + s)·h. Like the paper
    it leaves out the final layer norm (2h) and counts the tied output layer once.
    """
    h, f = model.h, model.ffn
    per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    return model.L * per_layer + (model.V + model.s) * h


def parameters_per_gpu(model: ModelShape, cfg: ParallelConfig, stage: str = "first") -> float:
    """Parameters one GPU holds: its L/p layers split t ways, plus the word embedding (split t
    ways, on the first stage and — tied weights, Megatron keeps a copy — on the last) and the
    position embedding (first stage). Layer norms and biases of the row-parallel layers are
    replicated, treated here as split (a <0.1 % error)."""
    h, f = model.h, model.ffn
    per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    n = model.L / cfg.pp * per_layer / cfg.tp
    if stage == "first" or cfg.pp == 1:
        n += model.V * h / cfg.tp + model.s * h
    elif stage == "last":
        n += model.V * h / cfg.tp
    return n


def flops_per_token(model: ModelShape) -> Dict[str, float]:
    """Matmul FLOPs per token, forward pass (Narayanan et al. 2021 §5.1, generalised to ffn).

    One layer: QKV + output projection 2·4h², MLP 2·2h·ffn, attention scores QKᵀ and the
    weighted sum of values 2·2·s·h (the full s×s product, as the paper counts it); logits 2hV.
    """
    layer = 2 * (4 * model.h ** 2 + 2 * model.h * model.ffn) + 4 * model.s * model.h
    return dict(layer=float(layer), attention_core=4.0 * model.s * model.h,
                logits=2.0 * model.h * model.V)


def model_flops_per_iteration(model: ModelShape, global_batch_size: int) -> float:
    """Model FLOPs of one iteration (forward + backward = 3 × forward, no recomputation):
    ``72 B s L h² (1 + s/(6h) + V/(12 L h))`` for ffn = 4h — Narayanan et al. 2021, Appendix,
    eq. (3) without the recomputation pass, i.e. 6N + 12·L·h·s per token (N without embeddings,
    plus 6hV for the logits). MFU counts these (Korthikanti et al. 2022 §6)."""
    f = flops_per_token(model)
    return 3.0 * global_batch_size * model.s * (model.L * f["layer"] + f["logits"])


def hardware_flops_per_iteration(model: ModelShape, global_batch_size: int,
                                 recompute: str = "none", recomputed_share: float = 1.0) -> float:
    """FLOPs the GPUs really execute: model FLOPs plus recomputation.

    ``full``: one more forward of every layer — Narayanan et al. 2021, Appendix, eq. (3):
    ``96 B s L h² (1 + s/(6h) + V/(16 L h))`` (8N + 16·L·h·s per token); the paper's reported
    TFLOP/s count these; of a ``recomputed_share`` of the layers only with Megatron's block
    method (:func:`recomputed_share`). ``selective``: one more forward of the attention core
    (QKᵀ and the weighted sum), Korthikanti et al. 2022 §5. HFU counts these (§6).
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if not 0 <= recomputed_share <= 1:
        raise ValueError(f"recomputed_share must be in [0, 1], got {recomputed_share!r}")
    f = flops_per_token(model)
    extra = {"none": 0.0, "selective": f["attention_core"],
             "full": recomputed_share * f["layer"]}[recompute]
    tokens = global_batch_size * model.s
    return model_flops_per_iteration(model, global_batch_size) + tokens * model.L * extra


# The papers' closed forms for ffn = 4h, by recomputation mode (Narayanan et al. 2021, Appendix).
FLOP_FORMS = {"none": "72·B·s·L·h²·(1 + s/(6h) + V/(12·h·L))",
              "full": "96·B·s·L·h²·(1 + s/(6h) + V/(16·h·L))"}


def paper_flops_per_iteration(model: ModelShape, global_batch_size: int,
                              recompute: str = "none") -> float:
    """The closed form of :data:`FLOP_FORMS` evaluated exactly (fractions), for a second
    method beside the matmul-by-matmul sums of :func:`model_flops_per_iteration` and
    :func:`hardware_flops_per_iteration`. The paper derives it for ffn = 4h only: other ffn
    sizes, and ``selective`` (no closed form in the paper), raise ValueError."""
    if recompute not in FLOP_FORMS:
        raise ValueError(f"the paper gives a closed form for recompute in {tuple(FLOP_FORMS)}, "
                         f"got {recompute!r}")
    if model.ffn != 4 * model.h:
        raise ValueError(f"the closed forms assume ffn = 4h = {4 * model.h}; this model has "
                         f"ffn {model.ffn}: use the matmul sums instead")
    B, s, L, h, V = global_batch_size, model.s, model.L, model.h, model.V
    factor, logits = (72, 12) if recompute == "none" else (96, 16)
    return float(factor * B * s * L * h * h
                 * (1 + Fraction(s, 6 * h) + Fraction(V, logits * h * L)))


def format_flop_counts(model: ModelShape, global_batch_size: int) -> str:
    """A small table: FLOPs of one iteration without recomputation (model FLOPs, what MFU
    counts), with selective and with full recomputation (hardware FLOPs, what HFU counts), each
    as the paper's closed form where there is one and as the sum of the matmuls, and its ratio
    to the model FLOPs."""
    base = model_flops_per_iteration(model, global_batch_size)
    rows = [("model FLOPs (MFU)", "none"), ("selective recompute (HFU)", "selective"),
            ("full recompute (HFU)", "full")]
    lines = [f"{model.name or 'model'}: one iteration of B = {global_batch_size} sequences "
             f"(s = {model.s}, L = {model.L}, h = {model.h}, V = {model.V})",
             f"{'FLOPs counted':<27}{'closed form (for ffn = 4h)':<40}{'= FLOPs':>11}"
             f"{'matmul sum':>12}{'/ model':>9}"]
    for label, mode in rows:
        total = hardware_flops_per_iteration(model, global_batch_size, mode)
        form = FLOP_FORMS.get(mode, "model FLOPs + attention core forward")
        closed = (f"{paper_flops_per_iteration(model, global_batch_size, mode):.4g}"
                  if mode in FLOP_FORMS and model.ffn == 4 * model.h else "-")
        lines.append(f"{label:<27}{form:<40}{closed:>11}{total:>12.4g}{total / base:>9.3f}")
    return "\n".join(lines)


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Pipeline bubble relative to the ideal compute time: ``(p-1)/m`` for GPipe and 1F1B, and
    ``(p-1)/(v·m)`` for the interleaved schedule with v model chunks per GPU (Narayanan et al.
    2021 §2.2.1–2.2.2). Its share of the whole iteration is ``(p-1)/(v·m + p-1)``."""
    for name, value in (("p", p), ("m", m), ("v", v)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return (p - 1) / (v * m)


def ring_all_reduce_factor(n: int) -> float:
    """Bytes each GPU sends per byte of message in a ring all-reduce: ``2(n-1)/n`` (a
    reduce-scatter then an all-gather, each ``(n-1)/n``; nccl-tests' busbw factor)."""
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    return 2 * (n - 1) / n


def recomputed_share(model: ModelShape, cfg: ParallelConfig) -> float:
    """The share of a stage's layers whose whole forward runs again in backward: 1 with full
    recomputation of every layer, ``N / (L/(p·v))`` with Megatron-core's block method
    (``recompute_num_layers`` = N of each model chunk), 0 otherwise (selective recomputes the
    attention core only)."""
    if cfg.recompute != "full":
        return 0.0
    if cfg.recompute_num_layers is None:
        return 1.0
    return min(1.0, cfg.recompute_num_layers / (model.L / (cfg.pp * cfg.v)))


def _collectives_per_layer(share: float) -> float:
    # Narayanan et al. 2021 §3.2 / Fig. 4: the f and g of the MLP and attention blocks give two
    # all-reduces in the forward pass and two in the backward; recomputing the forward
    # (full recomputation, of a share of the layers) runs the forward's two again. With sequence
    # parallelism each all-reduce becomes an all-gather + reduce-scatter pair of the same total
    # volume (Korthikanti et al. 2022 §4.2.2), so counting all-reduce equivalents covers both.
    return 4 + 2 * share


def tp_comm_per_layer(model: ModelShape, cfg: ParallelConfig, dtype_bytes: int = 2
                      ) -> Dict[str, float]:
    """Tensor-parallel traffic of one layer for one micro-batch, per GPU (Narayanan et al. 2021
    §3.2): ``count`` all-reduces (or AG + RS pairs) of ``b·s·h`` elements each — 4, 6 with full
    recomputation, on average between with the block method — and ``bytes`` each GPU sends in
    total: count × 2(t-1)/t × b·s·h × dtype_bytes."""
    count = _collectives_per_layer(recomputed_share(model, cfg)) if cfg.tp > 1 else 0
    message = cfg.b * model.s * model.h * dtype_bytes
    return dict(count=count, message_bytes=float(message),
                bytes=count * ring_all_reduce_factor(cfg.tp) * message)


def pipeline_p2p_bytes(model: ModelShape, cfg: ParallelConfig, dtype_bytes: int = 2) -> float:
    """Bytes one stage boundary carries per micro-batch in one direction: the ``b·s·h``
    activation, each of the t tensor-parallel ranks sending 1/t of it (the scatter/gather
    optimisation, Narayanan et al. 2021 §4.1; with sequence parallelism it is already split)."""
    if cfg.pp == 1:
        return 0.0
    return cfg.b * model.s * model.h * dtype_bytes / cfg.tp


def dp_allreduce_bytes(model: ModelShape, cfg: ParallelConfig, grad_bytes: int = 2) -> float:
    """Bytes each GPU sends in the data-parallel gradient all-reduce of one iteration:
    ``2(d-1)/d × params_per_gpu × grad_bytes`` (ring all-reduce; with the distributed optimizer
    a reduce-scatter of gradients plus an all-gather of parameters moves the same); ZeRO-3
    (``optim_grads_params``) all-gathers the weights twice (forward, backward) and
    reduce-scatters once: 1.5 x (Rajbhandari et al. 2020 §7.2.2)."""
    zero3 = 1.5 if cfg.sharding == "optim_grads_params" else 1.0
    return zero3 * ring_all_reduce_factor(cfg.dp) * parameters_per_gpu(model, cfg) * grad_bytes


def in_flight_microbatches(cfg: ParallelConfig) -> float:
    """Micro-batches whose activations the first stage holds at its peak: GPipe all m; 1F1B
    min(p, m) (Narayanan et al. 2021 §2.2.1); interleaved 1F1B p·(1 + (p-1)/(p·v)) micro-batch
    equivalents of a full stage (Korthikanti et al. 2022 §4.2.3)."""
    if cfg.schedule == "gpipe":
        return float(cfg.m)
    if cfg.v > 1:
        return cfg.p * (1 + (cfg.p - 1) / (cfg.p * cfg.v))
    return float(min(cfg.p, cfg.m))


def layer_activation_bytes(model: ModelShape, cfg: ParallelConfig, stored: bool) -> float:
    """Korthikanti Table 2 for one layer and one micro-batch. ``stored``: what the backward
    keeps (recomputation shrinks it: §5, ``sbh (10 + 24/t)`` or ``34 sbh/t`` with SP for
    selective, the layer's input ``2 sbh`` (``/t`` with SP) for full); otherwise what the
    forward writes (for traffic). A fused (flash) attention keeps no ``s x s`` tensor either,
    so it stores what selective recomputation stores."""
    mode = cfg.recompute if stored else "none"
    if cfg.flash_attention and mode == "none":
        mode = "selective"
    return activation_memory_per_layer(model.s, cfg.b, model.h, model.a, cfg.tp,
                                       cfg.sequence_parallel, recompute=mode)


def score_bytes(model: ModelShape, cfg: ParallelConfig) -> float:
    # the 5as²b/t of Table 2: softmax output, its dropout mask and the dropout's output
    return 5 * model.a * model.s * model.s * cfg.b / cfg.tp


def memory_per_gpu(model: ModelShape, cfg: ParallelConfig, dtype_bytes: int = 2,
                   grad_bytes: Optional[int] = None) -> Dict[str, float]:
    """Bytes on the busiest GPU (the first pipeline stage), by kind.

    Weights, gradients and optimizer states of Megatron's mixed-precision Adam, per parameter
    as in Megatron-core's "Distributed Optimizer" guide
    (:func:`~mpu_lab.perf.cost_model.optimizer_state.bytes_per_parameter_terms`): weights
    ``dtype_bytes`` (2: fp16 or bf16, 4: fp32) and gradients ``grad_bytes`` (default: the
    weights' width) on every rank; the fp32 main weight and main gradient where those are
    16-bit, and Adam's m and v, as ``optimizer`` — divided by d with the distributed
    optimizer. So 2 + 2 + 16 = 20 bytes (4 + 16/d), 2 + 4 + 12 = 18 (6 + 12/d), 4 + 4 + 8 = 16
    (8 + 8/d). Activations:
    Korthikanti et al. 2022 Table 2 (16-bit; scaled by dtype_bytes/2) per layer × L/p layers ×
    the schedule's in-flight micro-batches (1F1B keeps up to p on stage 0, §4.2.3); with full
    recomputation of every layer one layer's full activations are live again during its
    backward, counted once; with Megatron's block method (the first N layers of each chunk,
    :func:`recomputed_share`) the others keep everything, and by the time the first N are
    recomputed the later ones' activations are freed, so the peak is at the start of the
    backward pass. Not counted: the embedding and logits activations, temporary buffers,
    fragmentation.
    """
    grad_bytes = dtype_bytes if grad_bytes is None else grad_bytes
    terms = bytes_per_parameter_terms(dtype_for_bytes(dtype_bytes, "dtype_bytes"),
                                      dtype_for_bytes(grad_bytes, "grad_bytes"))
    n = parameters_per_gpu(model, cfg, "first")
    weights, grads = terms["replicated"]["param"] * n, terms["replicated"]["grad"] * n
    optimizer = sum(terms["sharded"].values()) * n
    if cfg.sharding != "no_shard":                  # ZeRO-1 and up: the optimizer states
        optimizer /= cfg.dp
    if cfg.sharding in ("optim_grads", "optim_grads_params"):     # ZeRO-2: the gradients
        grads /= cfg.dp
    if cfg.sharding == "optim_grads_params":        # ZeRO-3: the weights (a unit's whole
        weights /= cfg.dp                           # weights live only while it computes)
    layers_per_stage = model.L / cfg.pp
    scale = dtype_bytes / 2             # Table 2 counts 16-bit activations
    kept, whole = (layer_activation_bytes(model, cfg, stored) for stored in (True, False))
    share = recomputed_share(model, cfg)
    if cfg.recompute == "full":
        kept = share * kept + (1 - share) * whole
    activations = kept * layers_per_stage * in_flight_microbatches(cfg) * scale
    if share == 1:
        activations += whole * scale
    return dict(weights=weights, gradients=grads, optimizer=optimizer, activations=activations,
                total=weights + grads + optimizer + activations)
