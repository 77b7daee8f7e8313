"""The pure rank-group arithmetic of :mod:`mpu_lab.core.parallel_state`: which ranks talk to which,
for any world size and any order of the parallel dimensions, without starting a process.

This is Megatron-core's ``RankGenerator`` and ``generate_masked_orthogonal_rank_groups``
(``megatron/core/parallel_state.py``), written again here. Lab 01 draws its pictures from it;
the tests pin it to the MPU walkthrough's tables and to Megatron-core's own generator.

How a rank maps to coordinates. The world is a grid whose axes are the parallel dimensions
listed in ``order``, fastest-varying first. With Megatron-core's default
``order="tp-cp-ep-dp-pp"`` neighbouring ranks differ in their tensor-parallel coordinate, so a
tensor-parallel group is a run of adjacent ranks — and adjacent ranks sit in the same box,
where the links are fastest (the MPU walkthrough's "adjacent ranks on the same DGX box").

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))        (dense layers)

A group family such as ``"tp-pp"`` (the model-parallel group) holds the ranks that share every
coordinate *not* named in the family; inside a group the ranks are listed with the named
dimensions varying in ``order``.

Two views of one world. Megatron-core lays the same ranks out twice (``initialize_model_parallel``
builds two ``RankGenerator``\\ s):

* the **dense** layers (attention, dense MLPs): ``tp``, ``cp``, ``dp = n / (tp·cp·pp)``,
  ``pp``, with ``ep = 1``;
* the **experts** of a mixture-of-experts layer: ``tp = etp`` (the expert tensor-parallel
  size, by default the dense ``tp``), ``ep``, ``dp = n / (etp·ep·pp)`` (the *expert*
  data-parallel size), ``pp``, with ``cp = 1``.

So on the expert side ``ep`` takes the place (the stride) that ``cp`` and part of ``dp`` have
on the dense side: an expert-parallel group is carved out of ranks that, for the dense layers,
hold the same weights — the experts are split where the dense weights are replicated. The
pipeline groups must be the same in both views (a stage holds dense and expert layers alike).
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence

DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"          # Megatron-core's default

DENSE_FAMILIES = ("tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp", "tp-cp", "tp-dp-cp")
# mpu_lab's key -> the token Megatron-core's expert RankGenerator is asked for
EXPERT_FAMILIES = {"ep": "ep", "expert-tp": "tp", "expert-tp-ep": "tp-ep",
                   "expert-tp-ep-pp": "tp-ep-pp", "expert-dp": "dp"}


def parse_order(order: str, sizes: Dict[str, int]) -> List[str]:
    """Validate ``order`` and return its tokens, fastest-varying first.

    Every dimension of size > 1 must be named; dimensions of size 1 that are left out are
    appended (their position does not change any group). ``sizes`` may leave a dimension
    out: it then counts as size 1.
    """
    if not isinstance(order, str) or not order:
        raise ValueError(f"order must be a string such as {DEFAULT_ORDER!r}, got {order!r}")
    tokens = order.lower().split("-")
    unknown = [t for t in tokens if t not in DIMENSIONS]
    if unknown:
        raise ValueError(
            f"order {order!r} has unknown token(s) {unknown}; valid tokens are {list(DIMENSIONS)}"
        )
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise ValueError(f"order {order!r} repeats token(s) {repeated}; name each dimension once")
    for dim in DIMENSIONS:
        if dim not in tokens:
            if sizes.get(dim, 1) != 1:
                raise ValueError(
                    f"order {order!r} leaves out {dim!r}, whose size is {sizes[dim]}; only "
                    f"dimensions of size 1 may be left out (e.g. order={DEFAULT_ORDER!r})"
                )
            tokens.append(dim)
    return tokens


def _check_positive(named: Dict[str, object]) -> None:
    for name, value in named.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def check_sizes(world_size, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                context_parallel_size=1) -> int:
    """Raise ``ValueError`` naming the numbers if the sizes do not tile the world.

    Returns the data-parallel size ``world_size / (tp * pp * cp)``.
    """
    _check_positive({
        "world_size": world_size,
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "context_parallel_size": context_parallel_size,
    })
    model = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model:
        valid = [w for w in range(model, 4 * model + 1, model)]
        raise ValueError(
            f"world_size {world_size} is not divisible by tensor_model_parallel_size "
            f"{tensor_model_parallel_size} x pipeline_model_parallel_size "
            f"{pipeline_model_parallel_size} x context_parallel_size {context_parallel_size} "
            f"= {model}; Megatron needs p*t*c*d = n, so use a world size in {valid}... "
            f"or sizes whose product divides {world_size}"
        )
    return world_size // model


def check_expert_sizes(world_size, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                       expert_model_parallel_size=1,
                       expert_tensor_parallel_size: Optional[int] = None) -> int:
    """Raise ``ValueError`` naming the numbers if the expert sizes do not tile the world.

    ``expert_tensor_parallel_size=None`` means the dense ``tensor_model_parallel_size``, as in
    Megatron-core. Returns the expert data-parallel size ``world_size / (etp * ep * pp)``.
    """
    etp = tensor_model_parallel_size if expert_tensor_parallel_size is None \
        else expert_tensor_parallel_size
    _check_positive({"expert_model_parallel_size": expert_model_parallel_size,
                     "expert_tensor_parallel_size": etp})
    experts = etp * expert_model_parallel_size * pipeline_model_parallel_size
    if world_size % experts:
        raise ValueError(
            f"world_size {world_size} is not divisible by expert_tensor_parallel_size {etp} x "
            f"expert_model_parallel_size {expert_model_parallel_size} x "
            f"pipeline_model_parallel_size {pipeline_model_parallel_size} = {experts}; the "
            f"expert layers need etp*ep*p*d_expert = n: choose ep and etp whose product with "
            f"p divides {world_size}"
        )
    return world_size // experts


def orthogonal_rank_groups(sizes: Sequence[int], strides: Sequence[int], mask: Sequence[bool]
                           ) -> List[List[int]]:
    """Groups of ranks that vary along the masked axes and agree on all others.

    ``sizes``/``strides`` describe the rank grid axis by axis (fastest first). Groups are
    enumerated with the unmasked axes as the outer index, fastest axis first, and ranks inside
    a group with the masked axes, fastest axis first — the order Megatron-core uses.
    """
    inside = [(s, d) for s, d, m in zip(sizes, strides, mask) if m]
    outside = [(s, d) for s, d, m in zip(sizes, strides, mask) if not m]

    def offsets(axes):
        # itertools.product varies its *last* argument fastest; reverse so axis 0 is fastest.
        for coords in itertools.product(*[range(s) for s, _ in reversed(axes)]):
            yield sum(c * d for c, (_, d) in zip(reversed(coords), axes))

    return [[base + off for off in offsets(inside)] for base in offsets(outside)]


def rank_grid_groups(sizes: Dict[str, int], order: str, family: str) -> List[List[int]]:
    """The groups of ``family`` (e.g. ``"tp-dp"``) on the grid of ``sizes`` laid out in
    ``order``: Megatron-core's ``RankGenerator(**sizes, order=order).get_ranks(family)``."""
    tokens = parse_order(order, sizes)
    axis_sizes = [sizes.get(t, 1) for t in tokens]
    strides = [1]
    for s in axis_sizes[:-1]:
        strides.append(strides[-1] * s)
    members = set(family.split("-"))
    return orthogonal_rank_groups(axis_sizes, strides, [t in members for t in tokens])


def generate_rank_groups(world_size, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                         context_parallel_size=1, order=DEFAULT_ORDER,
                         expert_model_parallel_size=1,
                         expert_tensor_parallel_size: Optional[int] = None
                         ) -> Dict[str, List[List[int]]]:
    """All of Megatron's rank groups for a world, as lists of rank lists. Pure: no processes.

    >>> groups = generate_rank_groups(16, tensor_model_parallel_size=2,
    ...                               pipeline_model_parallel_size=4)
    >>> groups["tp"][:3], groups["pp"][0], groups["dp"][:2]
    ([[0, 1], [2, 3], [4, 5]], [0, 4, 8, 12], [[0, 2], [1, 3]])
    >>> generate_rank_groups(8, 2, expert_model_parallel_size=2)["ep"]
    [[0, 2], [1, 3], [4, 6], [5, 7]]

    Dense keys: ``tp``, ``cp``, ``dp``, ``pp``, ``dp-cp``, ``tp-pp`` (the model-parallel
    group), ``tp-dp``, ``tp-cp``, ``tp-dp-cp``, ``embedding`` (first and last stage of each
    pipeline) and ``position-embedding`` (first stage of each pipeline). Expert keys (the
    expert generator of the module docstring): ``ep``, ``expert-tp``, ``expert-tp-ep``,
    ``expert-tp-ep-pp``, ``expert-dp``. Bad sizes raise ``ValueError`` naming the numbers.
    """
    dp = check_sizes(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                     context_parallel_size)
    edp = check_expert_sizes(world_size, tensor_model_parallel_size,
                             pipeline_model_parallel_size, expert_model_parallel_size,
                             expert_tensor_parallel_size)
    etp = world_size // (edp * expert_model_parallel_size * pipeline_model_parallel_size)
    pp = pipeline_model_parallel_size
    dense = {"tp": tensor_model_parallel_size, "cp": context_parallel_size, "ep": 1, "dp": dp,
             "pp": pp}
    expert = {"tp": etp, "cp": 1, "ep": expert_model_parallel_size, "dp": edp, "pp": pp}
    parse_order(order, dense)
    parse_order(order, expert)
    # Megatron-core's two consistency rules for the expert layout. They are enforced where
    # experts are split (ep > 1 or etp != t) only, so that every dense layout accepted before
    # expert parallelism still is (e.g. cp > 1 with pp not last: without MoE layers no expert
    # group is ever used).
    experts_split = expert_model_parallel_size > 1 or etp != tensor_model_parallel_size
    if experts_split and not order.lower().endswith("pp") and pp > 1 and edp != dp:
        raise ValueError(
            f"order {order!r} does not put pp last, so the dense and the expert layers need the "
            f"same data-parallel size (Megatron-core's rule); here dp {dp} = {world_size} / "
            f"(tp {tensor_model_parallel_size} x cp {context_parallel_size} x pp {pp}) but the "
            f"expert data-parallel size is {edp} = {world_size} / (etp {etp} x ep "
            f"{expert_model_parallel_size} x pp {pp}): use an order ending in pp, e.g. "
            f"{DEFAULT_ORDER!r}")
    groups = {name: rank_grid_groups(dense, order, name) for name in DENSE_FAMILIES}
    expert_pp = rank_grid_groups(expert, order, "pp")
    if experts_split and expert_pp != groups["pp"]:
        raise ValueError(
            f"order {order!r} gives the expert layers other pipeline groups than the dense "
            f"layers ({expert_pp[:2]}... against {groups['pp'][:2]}...); a stage holds both: "
            f"use an order ending in pp, e.g. {DEFAULT_ORDER!r}")
    # Megatron-core: the word embedding is shared by the first and the last pipeline stage
    # (tied input/output embedding); the position embedding lives on the first stage only.
    groups["embedding"] = [[g[0], g[-1]] if len(g) > 1 else list(g) for g in groups["pp"]]
    groups["position-embedding"] = [[g[0]] for g in groups["pp"]]
    for key, token in EXPERT_FAMILIES.items():
        groups[key] = rank_grid_groups(expert, order, token)
    return groups


def rank_coordinates(rank, world_size, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                     context_parallel_size=1, order=DEFAULT_ORDER) -> Dict[str, int]:
    """The (tp, cp, dp, pp) coordinates of ``rank`` — its rank inside each dense group."""
    groups = generate_rank_groups(world_size, tensor_model_parallel_size,
                                  pipeline_model_parallel_size, context_parallel_size, order)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of size {world_size}")
    coords = {}
    for dim in ("tp", "cp", "dp", "pp"):
        (group,) = [g for g in groups[dim] if rank in g]
        coords[dim] = group.index(rank)
    return coords
