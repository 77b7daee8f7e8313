"""Rank groups of the model-parallel unit (MPU), after Megatron-core's ``parallel_state``.

Two halves:

* :func:`generate_rank_groups` is pure arithmetic. It answers "which ranks talk to which"
  for any world size and any order of the parallel dimensions, without starting a process.
  Lab 01 draws its pictures from it and the tests pin it to the MPU walkthrough's tables.
* :func:`initialize_model_parallel` turns those lists into real ``torch.distributed`` process
  groups and fills the getters (``get_tensor_model_parallel_rank`` and friends) that the
  rest of :mod:`mpu_lab` uses, exactly as Megatron code calls them.

How a rank maps to coordinates. The world is viewed as a grid whose axes are the parallel
dimensions listed in ``order``, fastest-varying first. With the default
``order="tp-cp-dp-pp"`` neighbouring ranks differ in their tensor-parallel coordinate, so a
tensor-parallel group is a run of adjacent ranks — and adjacent ranks sit in the same box,
where the links are fastest (the MPU walkthrough's "adjacent ranks on the same DGX box").

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

A group family such as ``"tp-pp"`` (the model-parallel group) holds the ranks that share every
coordinate *not* named in the family; inside a group the ranks are listed with the named
dimensions varying in ``order``. This is Megatron-core's ``RankGenerator`` /
``generate_masked_orthogonal_rank_groups`` rule, reimplemented here.
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence

DIMENSIONS = ("tp", "cp", "dp", "pp")
DEFAULT_ORDER = "tp-cp-dp-pp"

# Families created by initialize_model_parallel, in the order Megatron-core creates them.
GROUP_FAMILIES = (
    "dp", "dp-cp", "cp", "tp-pp", "tp", "pp", "embedding", "position-embedding",
    "tp-dp-cp", "tp-dp", "tp-cp",
)


# --------------------------------------------------------------------------- pure group math
def parse_order(order: str, sizes: Dict[str, int]) -> List[str]:
    """Validate ``order`` and return its tokens, fastest-varying first.

    Every dimension of size > 1 must be named; dimensions of size 1 that are left out are
    appended (their position does not change any group).
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
            if sizes[dim] != 1:
                raise ValueError(
                    f"order {order!r} leaves out {dim!r}, whose size is {sizes[dim]}; only "
                    f"dimensions of size 1 may be left out (e.g. order={DEFAULT_ORDER!r})"
                )
            tokens.append(dim)
    return tokens


def check_sizes(world_size, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                context_parallel_size=1) -> int:
    """Raise ``ValueError`` naming the numbers if the sizes do not tile the world.

    Returns the data-parallel size ``world_size / (tp * pp * cp)``.
    """
    named = {
        "world_size": world_size,
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "context_parallel_size": context_parallel_size,
    }
    for name, value in named.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
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


def _orthogonal_groups(sizes: Sequence[int], strides: Sequence[int], mask: Sequence[bool]):
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


def generate_rank_groups(world_size, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                         context_parallel_size=1, order=DEFAULT_ORDER) -> Dict[str, List[List[int]]]:
    """All of Megatron's rank groups for a world, as lists of rank lists. Pure: no processes.

    >>> groups = generate_rank_groups(16, tensor_model_parallel_size=2,
    ...                               pipeline_model_parallel_size=4)
    >>> groups["tp"][:3], groups["pp"][0], groups["dp"][:2]
    ([[0, 1], [2, 3], [4, 5]], [0, 4, 8, 12], [[0, 2], [1, 3]])

    Keys: ``tp``, ``cp``, ``dp``, ``pp``, ``dp-cp``, ``tp-pp`` (the model-parallel group),
    ``tp-dp``, ``tp-cp``, ``tp-dp-cp``, ``embedding`` (first and last stage of each pipeline)
    and ``position-embedding`` (first stage of each pipeline).
    """
    dp = check_sizes(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                     context_parallel_size)
    sizes = {"tp": tensor_model_parallel_size, "cp": context_parallel_size, "dp": dp,
             "pp": pipeline_model_parallel_size}
    tokens = parse_order(order, sizes)
    axis_sizes = [sizes[t] for t in tokens]
    strides = [1]
    for s in axis_sizes[:-1]:
        strides.append(strides[-1] * s)

    def family(name: str):
        members = set(name.split("-"))
        return _orthogonal_groups(axis_sizes, strides, [t in members for t in tokens])

    groups = {name: family(name) for name in
              ("tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp", "tp-cp", "tp-dp-cp")}
    # Megatron-core: the word embedding is shared by the first and the last pipeline stage
    # (tied input/output embedding); the position embedding lives on the first stage only.
    groups["embedding"] = [[g[0], g[-1]] if len(g) > 1 else list(g) for g in groups["pp"]]
    groups["position-embedding"] = [[g[0]] for g in groups["pp"]]
    return groups


def rank_coordinates(rank, world_size, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                     context_parallel_size=1, order=DEFAULT_ORDER) -> Dict[str, int]:
    """The (tp, cp, dp, pp) coordinates of ``rank`` — its rank inside each group."""
    groups = generate_rank_groups(world_size, tensor_model_parallel_size,
                                  pipeline_model_parallel_size, context_parallel_size, order)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of size {world_size}")
    coords = {}
    for dim in DIMENSIONS:
        (group,) = [g for g in groups[dim] if rank in g]
        coords[dim] = group.index(rank)
    return coords


# --------------------------------------------------------------------------- real groups
_STATE: Dict[str, object] = {}


def model_parallel_is_initialized() -> bool:
    """True between :func:`initialize_model_parallel` and :func:`destroy_model_parallel`."""
    return bool(_STATE)


_GROUP_TIMEOUT = None   # what initialize_model_parallel(timeout=None) gives the groups


def set_default_timeout(timeout) -> None:
    """The collective timeout (a ``datetime.timedelta``) of the groups that
    :func:`initialize_model_parallel` creates when it is not given one.

    ``torch.distributed.new_group`` without a timeout gets torch's default (30 minutes), not the
    default group's: a collective that only some ranks of a tensor-parallel group enter would
    then hang for half an hour. :func:`mpu_lab.distributed.init` sets this to the world's own
    timeout (Megatron passes ``--distributed-timeout-minutes`` to every group the same way)."""
    global _GROUP_TIMEOUT
    _GROUP_TIMEOUT = timeout


def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              context_parallel_size=1, order=DEFAULT_ORDER,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              timeout=None, backend=None):
    """Create every Megatron process group for the running ``torch.distributed`` world.

    Each rank calls this with the same arguments (collective: every rank creates every group,
    in the same order, as ``torch.distributed.new_group`` requires). The sizes are checked
    first, so a bad configuration raises ``ValueError`` before any group exists. ``timeout``
    (a ``timedelta``) defaults to :func:`set_default_timeout`'s.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call mpu_lab.distributed.init() first "
            "(inside a process started by torchrun)"
        )
    world_size, rank = dist.get_world_size(), dist.get_rank()
    groups = generate_rank_groups(world_size, tensor_model_parallel_size,
                                  pipeline_model_parallel_size, context_parallel_size, order)
    if virtual_pipeline_model_parallel_size is not None and virtual_pipeline_model_parallel_size < 1:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size must be >= 1 or None, got "
            f"{virtual_pipeline_model_parallel_size}"
        )
    if model_parallel_is_initialized():
        destroy_model_parallel()

    kwargs = {}
    timeout = timeout if timeout is not None else _GROUP_TIMEOUT
    if timeout is not None:
        kwargs["timeout"] = timeout
    if backend is not None:
        kwargs["backend"] = backend
    cache: Dict[tuple, object] = {}   # one process group per distinct rank list
    mine: Dict[str, object] = {}
    my_ranks: Dict[str, List[int]] = {}
    for name in GROUP_FAMILIES:
        for ranks in groups[name]:
            key = tuple(ranks)
            if key not in cache:
                # Every rank must call new_group for every group, members or not.
                cache[key] = dist.new_group(ranks=list(ranks), **kwargs)
            if rank in ranks:
                mine[name], my_ranks[name] = cache[key], list(ranks)
    _STATE.update(
        groups=mine, ranks=my_ranks, all_groups=groups, process_groups=cache,
        sizes={"tp": tensor_model_parallel_size, "pp": pipeline_model_parallel_size,
               "cp": context_parallel_size, "dp": len(groups["dp"][0])},
        order=order, virtual_pp_size=virtual_pipeline_model_parallel_size, virtual_pp_rank=0,
    )


def destroy_model_parallel():
    """Forget the groups (and free them) so :func:`initialize_model_parallel` can run again."""
    import torch.distributed as dist

    if _STATE and dist.is_initialized():
        for group in _STATE["process_groups"].values():
            if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
                try:
                    dist.destroy_process_group(group)
                except Exception:  # already gone with the default group
                    pass
    _STATE.clear()


def _check_initialized():
    if not _STATE:
        raise RuntimeError(
            "model parallel groups are not initialized: call "
            "mpu_lab.parallel_state.initialize_model_parallel(...) first"
        )


def _group(name):
    _check_initialized()
    if name not in _STATE["groups"]:
        import torch.distributed as dist
        raise RuntimeError(
            f"rank {dist.get_rank()} belongs to no {name!r} group (only the first and last "
            f"pipeline stages hold the embedding): check is_rank_in_embedding_group() first"
        )
    return _STATE["groups"][name]


def _rank_in(name):
    import torch.distributed as dist
    return _ranks(name).index(dist.get_rank())


def _ranks(name) -> List[int]:
    _group(name)
    return _STATE["ranks"][name]


def get_group_ranks(name: str) -> Optional[List[int]]:
    """Global ranks of this rank's group in family ``name`` (e.g. ``"tp"``, ``"embedding"``);
    None when this rank is in no group of that family (embedding groups only)."""
    _check_initialized()
    ranks = _STATE["ranks"].get(name)
    return list(ranks) if ranks is not None else None


def get_tensor_model_parallel_group():
    return _group("tp")


def get_pipeline_model_parallel_group():
    return _group("pp")


def get_data_parallel_group(with_context_parallel=False):
    return _group("dp-cp" if with_context_parallel else "dp")


def get_context_parallel_group():
    return _group("cp")


def get_model_parallel_group():
    return _group("tp-pp")


def get_embedding_group():
    return _group("embedding")


def get_position_embedding_group():
    return _group("position-embedding")


def get_tensor_model_parallel_world_size():
    return len(_ranks("tp"))


def get_pipeline_model_parallel_world_size():
    return len(_ranks("pp"))


def get_data_parallel_world_size(with_context_parallel=False):
    return len(_ranks("dp-cp" if with_context_parallel else "dp"))


def get_context_parallel_world_size():
    return len(_ranks("cp"))


def get_tensor_model_parallel_rank():
    return _rank_in("tp")


def get_pipeline_model_parallel_rank():
    return _rank_in("pp")


def get_data_parallel_rank(with_context_parallel=False):
    return _rank_in("dp-cp" if with_context_parallel else "dp")


def get_context_parallel_rank():
    return _rank_in("cp")


def get_tensor_model_parallel_src_rank():
    """Global rank of the first rank in this tensor-parallel group (broadcast source)."""
    return _ranks("tp")[0]


def get_pipeline_model_parallel_first_rank():
    return _ranks("pp")[0]


def get_pipeline_model_parallel_last_rank():
    return _ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank():
    """Global rank of the next pipeline stage (wrapping around, as in Megatron)."""
    ranks = _ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank():
    """Global rank of the previous pipeline stage (wrapping around, as in Megatron)."""
    ranks = _ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def get_virtual_pipeline_model_parallel_world_size():
    _group("pp")
    return _STATE["virtual_pp_size"]


def get_virtual_pipeline_model_parallel_rank():
    _group("pp")
    return _STATE["virtual_pp_rank"]


def set_virtual_pipeline_model_parallel_rank(rank):
    _group("pp")
    _STATE["virtual_pp_rank"] = rank


def is_pipeline_first_stage(ignore_virtual=False):
    """True on the first pipeline stage (and, with virtual stages, on the first chunk)."""
    if not ignore_virtual and _STATE.get("virtual_pp_size") and get_virtual_pipeline_model_parallel_rank() != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=False):
    """True on the last pipeline stage (and, with virtual stages, on the last chunk)."""
    vpp = _STATE.get("virtual_pp_size")
    if not ignore_virtual and vpp and get_virtual_pipeline_model_parallel_rank() != vpp - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual=False):
    """True on ranks that hold the (tied) word embedding: first and last pipeline stages."""
    _check_initialized()
    return "embedding" in _STATE["ranks"]


def is_rank_in_position_embedding_group():
    _check_initialized()
    return "position-embedding" in _STATE["ranks"]


def describe() -> Dict[str, object]:
    """This rank's coordinates and groups as plain data (what lab 01's torchrun job prints)."""
    import torch.distributed as dist
    return {
        "rank": dist.get_rank(),
        "tp_rank": get_tensor_model_parallel_rank(),
        "pp_rank": get_pipeline_model_parallel_rank(),
        "dp_rank": get_data_parallel_rank(),
        "cp_rank": get_context_parallel_rank(),
        "groups": {name: get_group_ranks(name) for name in GROUP_FAMILIES},  # None: not a member
    }
