"""Rank groups of the model-parallel unit (MPU), after Megatron-core's ``parallel_state``.

Two halves:

* :func:`generate_rank_groups` is pure arithmetic. It answers "which ranks talk to which"
  for any world size and any order of the parallel dimensions, without starting a process.
  It lives in :mod:`mpu_lab.core.parallel_state_groups` (Megatron-core's ``RankGenerator``, with how
  a rank maps to coordinates and how the expert layers see the same world) and is re-exported
  here, with its helpers, under the names Megatron code uses.
* :func:`initialize_model_parallel` turns those lists into real ``torch.distributed`` process
  groups and fills the getters (``get_tensor_model_parallel_rank``,
  ``get_expert_model_parallel_group`` and friends) that the rest of :mod:`mpu_lab` uses,
  exactly as Megatron code calls them.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from mpu_lab.core.parallel_state_groups import (  # noqa: F401  (re-exported)
    DEFAULT_ORDER, DENSE_FAMILIES, DIMENSIONS, EXPERT_FAMILIES, check_expert_sizes, check_sizes,
    generate_rank_groups, orthogonal_rank_groups, parse_order, rank_coordinates, rank_grid_groups)

# Families created by initialize_model_parallel, in the order Megatron-core creates them:
# the dense groups, then the expert groups.
GROUP_FAMILIES = (
    "dp", "dp-cp", "cp", "tp-pp", "tp", "pp", "embedding", "position-embedding",
    "tp-dp-cp", "tp-dp", "tp-cp",
    "ep", "expert-tp", "expert-tp-ep", "expert-tp-ep-pp", "expert-dp",
)


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
    then hang for half an hour. :func:`mpu_lab.training.initialize.init` sets this to the world's own
    timeout (Megatron passes ``--distributed-timeout-minutes`` to every group the same way)."""
    global _GROUP_TIMEOUT
    _GROUP_TIMEOUT = timeout


def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              context_parallel_size=1, order=DEFAULT_ORDER,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              timeout=None, backend=None, expert_model_parallel_size=1,
                              expert_tensor_parallel_size: Optional[int] = None):
    """Create every Megatron process group for the running ``torch.distributed`` world.

    Each rank calls this with the same arguments (collective: every rank creates every group,
    in the same order, as ``torch.distributed.new_group`` requires). The sizes are checked
    first, so a bad configuration raises ``ValueError`` before any group exists. ``timeout``
    (a ``timedelta``) defaults to :func:`set_default_timeout`'s. ``expert_model_parallel_size``
    and ``expert_tensor_parallel_size`` (None: the tensor-parallel size) lay out the expert
    groups of mixture-of-experts layers, as Megatron-core's expert ``RankGenerator``.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call mpu_lab.training.initialize.init() first "
            "(inside a process started by torchrun)"
        )
    world_size, rank = dist.get_world_size(), dist.get_rank()
    groups = generate_rank_groups(world_size, tensor_model_parallel_size,
                                  pipeline_model_parallel_size, context_parallel_size, order,
                                  expert_model_parallel_size, expert_tensor_parallel_size)
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
               "cp": context_parallel_size, "dp": len(groups["dp"][0]),
               "ep": expert_model_parallel_size, "etp": len(groups["expert-tp"][0]),
               "edp": len(groups["expert-dp"][0])},
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
            "mpu_lab.core.parallel_state.initialize_model_parallel(...) first"
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


def get_expert_model_parallel_group():
    """The expert-model-parallel group: the ranks that split the experts of a layer."""
    return _group("ep")


def get_expert_tensor_parallel_group():
    """The expert-tensor-parallel group: the ranks that split one expert's weights."""
    return _group("expert-tp")


def get_expert_tensor_and_model_parallel_group():
    """The expert tensor x expert model parallel group (a token dispatcher's all-to-all)."""
    return _group("expert-tp-ep")


def get_expert_tensor_model_pipeline_parallel_group():
    return _group("expert-tp-ep-pp")


def get_expert_data_parallel_group():
    """The expert-data-parallel group: the ranks that hold the same experts and average
    their gradients (not the dense data-parallel group)."""
    return _group("expert-dp")


def get_expert_model_parallel_world_size():
    return len(_ranks("ep"))


def get_expert_tensor_parallel_world_size():
    return len(_ranks("expert-tp"))


def get_expert_tensor_and_model_parallel_world_size():
    return len(_ranks("expert-tp-ep"))


def get_expert_data_parallel_world_size():
    return len(_ranks("expert-dp"))


def get_expert_model_parallel_rank():
    return _rank_in("ep")


def get_expert_tensor_parallel_rank():
    return _rank_in("expert-tp")


def get_expert_tensor_and_model_parallel_rank():
    return _rank_in("expert-tp-ep")


def get_expert_data_parallel_rank():
    return _rank_in("expert-dp")


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
        "ep_rank": get_expert_model_parallel_rank(),
        "expert_tp_rank": get_expert_tensor_parallel_rank(),
        "expert_dp_rank": get_expert_data_parallel_rank(),
        "groups": {name: get_group_ranks(name) for name in GROUP_FAMILIES},  # None: not a member
    }
