"""Which layers live on which pipeline stage, and the checks that run before any process starts.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", §2.2: a model of ``L`` layers is cut into ``p`` stages of ``L/p`` consecutive
layers. With the interleaved schedule (§2.2.2) each of the ``p`` devices holds ``v`` *model
chunks* ("virtual stages") of ``L/(p·v)`` layers, and chunk ``k`` of pipeline rank ``r`` is
virtual stage ``k·p + r``. Example, 8 layers, ``p = 2``, ``v = 2``:

    virtual stage:  0          1          2          3
    held by:        rank 0/k0  rank 1/k0  rank 0/k1  rank 1/k1
    layers:         0-1        2-3        4-5        6-7

The embedding sits on virtual stage 0 (rank 0, chunk 0), the output layer and the loss on the
last virtual stage (rank p-1, chunk v-1), as in Megatron's ``pre_process``/``post_process``.

The V schedules (``ZBVZeroBubble``, Qi et al. 2024 §6; ``DualPipeV``) cut the model into ``2p``
stages too, but lay them out in a V: rank ``r`` holds stage ``r`` (chunk 0) and stage
``2p - 1 - r`` (chunk 1), so the embedding *and* the loss are on rank 0 (:func:`v_stage_table`).

Every check raises ``ValueError`` naming the numbers and what would be valid, and runs before
any process starts, so a configuration that cannot work fails early and says why.
"""
from __future__ import annotations

from typing import Dict, List, Optional

# Canonical schedule names, and the spellings accepted for them (any case).
SCHEDULES = ("no-pipelining", "gpipe", "1f1b", "interleaved", "zbh1", "zbv", "dualpipev")
_ALIASES = {
    "none": "no-pipelining", "no_pipelining": "no-pipelining", "no-pipelining": "no-pipelining",
    "gpipe": "gpipe", "afab": "gpipe", "all-forward-all-backward": "gpipe",
    "1f1b": "1f1b", "pipedream-flush": "1f1b", "non-interleaved": "1f1b",
    "interleaved": "interleaved", "interleaved-1f1b": "interleaved",
    "interleaved1f1b": "interleaved",
    "zbh1": "zbh1", "zb-h1": "zbh1", "zbv": "zbv", "zb-v": "zbv", "zbvzerobubble": "zbv",
    "dualpipev": "dualpipev",
}
# torch.distributed.pipelining's class names (Schedule<name>), and ZBH1 for the zero-bubble
# paper's handcrafted schedule 1: what launch/train_gpt.py prints and stores.
TORCH_NAMES = {"no-pipelining": "no-pipelining", "gpipe": "GPipe", "1f1b": "1F1B",
               "interleaved": "Interleaved1F1B", "zbh1": "ZBH1", "zbv": "ZBVZeroBubble",
               "dualpipev": "DualPipeV"}
V_SCHEDULES = ("zbv", "dualpipev")      # two chunks per rank in a V


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _vpp(virtual_pipeline_model_parallel_size: Optional[int]) -> int:
    if virtual_pipeline_model_parallel_size is None:
        return 1
    return _positive("virtual_pipeline_model_parallel_size", virtual_pipeline_model_parallel_size)


def canonical_schedule(name: str) -> str:
    """The canonical name (one of :data:`SCHEDULES`) for any accepted spelling."""
    key = str(name).strip().lower().replace(" ", "-")
    if key not in _ALIASES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {list(SCHEDULES)} "
                         f"(aliases: {sorted(k for k in _ALIASES if k not in SCHEDULES)})")
    return _ALIASES[key]


def torch_schedule_name(name: str) -> str:
    """torch's name (``"1F1B"``, ``"ZBVZeroBubble"``, ...) for any accepted spelling."""
    return TORCH_NAMES[canonical_schedule(name)]


def v_stage_table(num_layers: int, pipeline_model_parallel_size: int) -> List[Dict]:
    """One row per model chunk of a V schedule, in stage order: stage ``s < p`` is chunk 0 of
    rank ``s``, stage ``s >= p`` chunk 1 of rank ``2p - 1 - s``; ``L / 2p`` layers each.

    >>> [(r["pp_rank"], r["chunk"], list(r["layers"])) for r in v_stage_table(8, 2)]
    [(0, 0, [0, 1]), (1, 0, [2, 3]), (1, 1, [4, 5]), (0, 1, [6, 7])]
    """
    p = _positive("pipeline_model_parallel_size", pipeline_model_parallel_size)
    per_chunk = check_layers_v(num_layers, p)
    rows = []
    for stage in range(2 * p):
        rank, chunk = (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
        rows.append(dict(virtual_stage=stage, pp_rank=rank, chunk=chunk,
                         layers=range(stage * per_chunk, (stage + 1) * per_chunk),
                         pre_process=stage == 0, post_process=stage == 2 * p - 1))
    return rows


def check_layers_v(num_layers: int, pipeline_model_parallel_size: int) -> int:
    """Layers per chunk of a V schedule, ``L / 2p``; raises when it is not a whole number."""
    L = _positive("num_layers", num_layers)
    p = _positive("pipeline_model_parallel_size", pipeline_model_parallel_size)
    if L % (2 * p):
        raise ValueError(
            f"num_layers {L} is not divisible by 2 x pipeline_model_parallel_size {p} = {2 * p}: "
            f"a V schedule cuts the model into 2p stages of equal size; use num_layers in "
            f"{[2 * p * k for k in range(1, 5)]}...")
    return L // (2 * p)


def default_schedule(pipeline_model_parallel_size: int,
                     virtual_pipeline_model_parallel_size: Optional[int] = None) -> str:
    """Megatron's ``get_forward_backward_func()`` rule: interleaved when virtual stages are
    set, 1F1B when ``p > 1``, no pipelining otherwise."""
    if pipeline_model_parallel_size > 1:
        return "interleaved" if _vpp(virtual_pipeline_model_parallel_size) > 1 else "1f1b"
    return "no-pipelining"


# --------------------------------------------------------------------------- layers
def check_layers(num_layers: int, pipeline_model_parallel_size: int,
                 virtual_pipeline_model_parallel_size: Optional[int] = None) -> int:
    """Layers per model chunk, ``L / (p·v)``; raises when it is not a whole number."""
    L = _positive("num_layers", num_layers)
    p = _positive("pipeline_model_parallel_size", pipeline_model_parallel_size)
    v = _vpp(virtual_pipeline_model_parallel_size)
    if L % (p * v):
        if v == 1:
            raise ValueError(
                f"num_layers {L} is not divisible by pipeline_model_parallel_size {p}: every "
                f"stage needs the same number of layers; use num_layers in "
                f"{[p * k for k in range(1, 5)]}... or a pipeline size dividing {L}")
        raise ValueError(
            f"num_layers {L} is not divisible by pipeline_model_parallel_size {p} x "
            f"virtual_pipeline_model_parallel_size {v} = {p * v}: every model chunk needs the "
            f"same number of layers (L / (p*v)); use num_layers in "
            f"{[p * v * k for k in range(1, 5)]}...")
    return L // (p * v)


def virtual_size_from_layers_per_virtual_stage(num_layers: int, pipeline_model_parallel_size: int,
                                               num_layers_per_virtual_pipeline_stage: int) -> int:
    """``v`` from Megatron's ``--num-layers-per-virtual-pipeline-stage`` flag:
    ``v = (L / p) / layers_per_virtual_stage``."""
    L = _positive("num_layers", num_layers)
    p = _positive("pipeline_model_parallel_size", pipeline_model_parallel_size)
    n = _positive("num_layers_per_virtual_pipeline_stage", num_layers_per_virtual_pipeline_stage)
    check_layers(L, p)
    per_stage = L // p
    if per_stage % n:
        raise ValueError(
            f"num_layers_per_virtual_pipeline_stage {n} does not divide the {per_stage} layers of "
            f"each stage (num_layers {L} / pipeline_model_parallel_size {p}); use a divisor of "
            f"{per_stage}: {[d for d in range(1, per_stage + 1) if per_stage % d == 0]}")
    return per_stage // n


def layer_offset(num_layers: int, pipeline_model_parallel_size: int, pipeline_model_parallel_rank: int,
                 virtual_pipeline_model_parallel_size: Optional[int] = None,
                 virtual_pipeline_model_parallel_rank: int = 0) -> int:
    """Global index of the first layer of chunk ``vp_rank`` on pipeline rank ``pp_rank``
    (Megatron's ``TransformerBlock._get_layer_offset``): virtual stage ``k·p + r`` times
    ``L/(p·v)``."""
    per_chunk = check_layers(num_layers, pipeline_model_parallel_size,
                             virtual_pipeline_model_parallel_size)
    p, v = pipeline_model_parallel_size, _vpp(virtual_pipeline_model_parallel_size)
    r, k = pipeline_model_parallel_rank, virtual_pipeline_model_parallel_rank
    if not 0 <= r < p:
        raise ValueError(f"pipeline_model_parallel_rank {r} is outside 0..{p - 1}")
    if not 0 <= k < v:
        raise ValueError(f"virtual_pipeline_model_parallel_rank {k} is outside 0..{v - 1}")
    return (k * p + r) * per_chunk


def stage_layers(num_layers: int, pipeline_model_parallel_size: int, pipeline_model_parallel_rank: int,
                 virtual_pipeline_model_parallel_size: Optional[int] = None,
                 virtual_pipeline_model_parallel_rank: int = 0) -> range:
    """The global layer indices held by one model chunk."""
    per_chunk = check_layers(num_layers, pipeline_model_parallel_size,
                             virtual_pipeline_model_parallel_size)
    start = layer_offset(num_layers, pipeline_model_parallel_size, pipeline_model_parallel_rank,
                         virtual_pipeline_model_parallel_size, virtual_pipeline_model_parallel_rank)
    return range(start, start + per_chunk)


def partition_table(num_layers: int, pipeline_model_parallel_size: int,
                    virtual_pipeline_model_parallel_size: Optional[int] = None) -> List[Dict]:
    """One row per model chunk, in virtual-stage order: what lab 11 prints as the layer map.

    >>> [(r["pp_rank"], r["chunk"], list(r["layers"])) for r in partition_table(8, 2, 2)]
    [(0, 0, [0, 1]), (1, 0, [2, 3]), (0, 1, [4, 5]), (1, 1, [6, 7])]
    """
    p, v = pipeline_model_parallel_size, _vpp(virtual_pipeline_model_parallel_size)
    check_layers(num_layers, p, v)
    rows = []
    for stage in range(p * v):
        k, r = divmod(stage, p)
        rows.append(dict(virtual_stage=stage, pp_rank=r, chunk=k,
                         layers=stage_layers(num_layers, p, r, v, k),
                         pre_process=stage == 0, post_process=stage == p * v - 1))
    return rows


# --------------------------------------------------------------------------- batches, schedules
def get_num_microbatches(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """Micro-batches per iteration on each data-parallel replica: ``B / (b · d)``."""
    B = _positive("global_batch_size", global_batch_size)
    b = _positive("micro_batch_size", micro_batch_size)
    d = _positive("data_parallel_size", data_parallel_size)
    if B % (b * d):
        raise ValueError(
            f"global_batch_size {B} is not divisible by micro_batch_size {b} x data_parallel_size "
            f"{d} = {b * d}; use a global batch in {[b * d * k for k in range(1, 5)]}...")
    return B // (b * d)


def check_schedule(schedule: str, pipeline_model_parallel_size: int, num_microbatches: int,
                   virtual_pipeline_model_parallel_size: Optional[int] = None) -> str:
    """Raise if ``schedule`` cannot run with these sizes; return its canonical name."""
    name = canonical_schedule(schedule)
    p = _positive("pipeline_model_parallel_size", pipeline_model_parallel_size)
    m = _positive("num_microbatches", num_microbatches)
    v = _vpp(virtual_pipeline_model_parallel_size)
    if name == "no-pipelining" and p != 1:
        raise ValueError(f"schedule 'no-pipelining' runs a single stage, but "
                         f"pipeline_model_parallel_size is {p}; use '1f1b', 'gpipe' or 'interleaved'")
    if name != "interleaved" and v != 1:
        raise ValueError(f"schedule {TORCH_NAMES[name]!r} runs "
                         f"{'its own two (V) chunks' if name in V_SCHEDULES else 'one model chunk'}"
                         f" per stage, but virtual_pipeline_model_parallel_size is {v}; use "
                         f"'Interleaved1F1B'")
    if name == "dualpipev" and m < 2 * p:
        # torch's ScheduleDualPipeV: its steady state needs as many micro-batches as stages.
        raise ValueError(f"DualPipeV needs num_microbatches >= 2 x pipeline_model_parallel_size "
                         f"= {2 * p} (as many as its stages), got {m}")
    if name == "interleaved":
        if p < 2:
            raise ValueError(f"the interleaved schedule needs pipeline_model_parallel_size >= 2, "
                             f"got {p}")
        if v < 2:
            raise ValueError(f"the interleaved schedule needs virtual_pipeline_model_parallel_size "
                             f">= 2 model chunks per stage, got {v}")
        if m % p:
            # Megatron (Narayanan et al. 2021, §2.2.2): micro-batches go round the stages in
            # groups of p, so m must be a multiple of p (and hence at least p).
            raise ValueError(
                f"the interleaved schedule needs num_microbatches divisible by "
                f"pipeline_model_parallel_size: {m} micro-batches for {p} stages; use "
                f"num_microbatches in {[p * k for k in range(1, 5)]}...")
    return name


def validate_pipeline_args(*, num_layers: int, pipeline_model_parallel_size: int,
                           global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                           schedule: Optional[str] = None,
                           virtual_pipeline_model_parallel_size: Optional[int] = None,
                           num_layers_per_virtual_pipeline_stage: Optional[int] = None) -> Dict:
    """Every pipeline check a launcher runs before starting processes, in one call.

    Returns ``dict(schedule, num_microbatches, virtual_pipeline_model_parallel_size,
    layers_per_chunk)``. ``schedule=None`` picks Megatron's default.
    """
    p = _positive("pipeline_model_parallel_size", pipeline_model_parallel_size)
    if num_layers_per_virtual_pipeline_stage is not None:
        v_from_flag = virtual_size_from_layers_per_virtual_stage(
            num_layers, p, num_layers_per_virtual_pipeline_stage)
        if virtual_pipeline_model_parallel_size not in (None, v_from_flag):
            raise ValueError(
                f"virtual_pipeline_model_parallel_size {virtual_pipeline_model_parallel_size} "
                f"disagrees with num_layers_per_virtual_pipeline_stage "
                f"{num_layers_per_virtual_pipeline_stage}, which gives {v_from_flag}")
        virtual_pipeline_model_parallel_size = v_from_flag
    v = _vpp(virtual_pipeline_model_parallel_size)
    per_chunk = check_layers(num_layers, p, v)
    m = get_num_microbatches(global_batch_size, micro_batch_size, data_parallel_size)
    name = check_schedule(schedule or default_schedule(p, v), p, m, v)
    if name in V_SCHEDULES:
        per_chunk = check_layers_v(num_layers, p)
    return dict(schedule=name, num_microbatches=m,
                virtual_pipeline_model_parallel_size=v if v > 1 else None,
                layers_per_chunk=per_chunk)
