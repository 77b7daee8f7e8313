"""The sharded state dict of a model: each tensor-parallel shard as a ``DTensor`` over the
tensor-parallel group with its global shape, layers under their *global* numbers, the last
stage's tied-embedding copy left out, plus the RNG states and the run's flags — what
``torch.distributed.checkpoint`` saves and reads back at any TP and PP size (Megatron's
``sharded_state_dict`` of ``megatron/core/dist_checkpointing``, on DCP instead)."""
from __future__ import annotations

import re
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state
from mpu_lab.core.pipeline_parallel import model_chunks_of
from mpu_lab.core.tensor_parallel import get_rng_tracker

_MESHES: Dict[tuple, Any] = {}


def is_expert(param) -> bool:
    """A mixture-of-experts parameter (Megatron's mark ``allreduce = False``): split over the
    *expert*-tensor-parallel group, held by one expert-parallel rank."""
    return not getattr(param, "allreduce", True)


def _split_family(param) -> str:
    """The group family a split parameter is sliced over."""
    return "expert-tp" if is_expert(param) else "tp"


def _tp_mesh(param=None):
    from torch.distributed.device_mesh import DeviceMesh   # heavy (torch.distributed.tensor)
    family = _split_family(param)
    group = parallel_state.get_expert_tensor_parallel_group() if family == "expert-tp" \
        else parallel_state.get_tensor_model_parallel_group()
    key = (family, tuple(parallel_state.get_group_ranks(family)))
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, "cpu")
    return _MESHES[key]


def _split_size(param) -> int:
    if is_expert(param):
        return parallel_state.get_expert_tensor_parallel_world_size()
    return parallel_state.get_tensor_model_parallel_world_size()


def is_split(param) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False)) and _split_size(param) > 1


def global_shape(param, local_shape) -> torch.Size:
    shape = list(local_shape)
    if is_split(param):
        if getattr(param, "partition_stride", 1) != 1:
            raise NotImplementedError("interleaved (stride > 1) shards cannot be saved as DTensors")
        shape[param.partition_dim] *= _split_size(param)
    return torch.Size(shape)


def as_saved(local: torch.Tensor, param):
    """``local`` (this rank's piece, on the CPU) as DCP should see it."""
    if not is_split(param):
        return local
    from torch.distributed.tensor import DTensor, Shard   # heavy: only when saving a shard
    shape = global_shape(param, local.shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, _tp_mesh(param), [Shard(param.partition_dim)], run_check=False,
                              shape=shape, stride=stride)


_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
TIED_EMBEDDING = "embedding.word_embeddings.weight"


def checkpoint_names(model) -> List[tuple]:
    """``(name, parameter, is_copy)`` for every parameter of ``model`` (a module, or a list of
    pipeline model chunks): the name the one-stage model gives it — layers numbered globally
    (their ``layer_number``) — and ``is_copy`` for the last stage's copy of the tied embedding,
    which is named like the embedding, loaded from it and never saved. Experts are named by
    their global number (Megatron's ``local_experts.{i}`` of expert-parallel rank r is expert
    ``r * E / ep + i``), so a checkpoint loads at any expert-parallel size."""
    out = []
    for chunk in model_chunks_of(model):
        for name, p in chunk.named_parameters():
            if getattr(p, "shared", False):
                out.append((TIED_EMBEDDING, p, True))
                continue
            match = _LAYER_NAME.match(name)
            if match:
                layer = chunk.decoder.layers[int(match.group(1))]
                number = getattr(layer, "layer_number", int(match.group(1)))
                rest = match.group(2)
                expert = _LOCAL_EXPERT.match(rest)
                if expert:   # local expert i is global expert ep_rank * E / ep + i
                    index = layer.mlp.local_expert_indices[int(expert.group(1))]
                    rest = f"mlp.experts.local_experts.{index}.{expert.group(2)}"
                name = f"decoder.layers.{number}.{rest}"
            out.append((name, p, False))
    return out


def named_params(model):
    """The parameters to save, with their checkpoint names."""
    return [(n, p) for n, p, copy in checkpoint_names(model) if not copy]


def pipeline_union(names: List[str]) -> List[str]:
    """The names held by the whole pipeline (every stage's), on every stage; with experts
    spread over expert-parallel ranks, every expert's too."""
    names = list(names)
    for size, group in ((parallel_state.get_pipeline_model_parallel_world_size(),
                         parallel_state.get_pipeline_model_parallel_group),
                        (parallel_state.get_expert_model_parallel_world_size(),
                         parallel_state.get_expert_model_parallel_group)):
        if size > 1:
            gathered: List[Any] = [None] * size
            dist.all_gather_object(gathered, names, group=group())
            names = sorted({n for part in gathered for n in part})
    return names


def rng_state_dict(prefix: str) -> Dict[str, torch.Tensor]:
    out = {f"{prefix}.cpu": torch.get_rng_state()}
    device = initialize.get_device()
    if device.type == "cuda":
        out[f"{prefix}.cuda"] = torch.cuda.get_rng_state(device)
    for name, (cpu, cuda) in get_rng_tracker().get_states().items():
        out[f"{prefix}.tracker.{name}.cpu"] = cpu
        if cuda is not None:
            out[f"{prefix}.tracker.{name}.cuda"] = cuda
    return out


def jsonable_args(args) -> Dict[str, Any]:
    out = {}
    for k, v in vars(args).items():
        if v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
        else:
            out[k] = str(v)
    return out
