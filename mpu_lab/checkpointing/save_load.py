"""Saving and loading a :class:`~mpu_lab.training.TrainState` with ``torch.distributed.checkpoint``
(Megatron's ``save_checkpoint`` / ``load_checkpoint`` of ``megatron/training/checkpointing.py``):
collective, resharding across tensor- and pipeline-parallel sizes, the completeness marker
written by rank 0 after DCP returned, every mismatch named before anything is read, and the test
hook ``MPU_LAB_FAULT_IN_SAVE`` that kills a rank mid-save."""
from __future__ import annotations

import datetime
import json
import os
import pathlib
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from mpu_lab import distributed, parallel_state
from mpu_lab.optimizer import DistributedOptimizer
from mpu_lab.checkpointing.files import (
    MARKER,
    TRACKER,
    CheckpointError,
    check_compatible,
    file_records,
    iteration_dir,
    model_fields,
    read_checkpoint_info,
    verify_checkpoint,
)
from mpu_lab.checkpointing import vocab_padding
from mpu_lab.checkpointing.state_dict import (
    _as_saved,
    _is_split,
    _global_shape,
    _jsonable_args,
    _named_params,
    _pipeline_union,
    _rng_state_dict,
    checkpoint_names,
)
from mpu_lab.tensor_parallel import get_rng_tracker


def _fault_writer(d: pathlib.Path, rank: int, iteration: int):
    """DCP's default writer, or — when ``MPU_LAB_FAULT_IN_SAVE`` is ``"<rank>:<iteration>"``
    for this rank and iteration — one that exits the process right after writing this rank's
    data file, before DCP's metadata: a rank killed mid-save (the reliability tests)."""
    fault = os.environ.get("MPU_LAB_FAULT_IN_SAVE", "")
    if fault != f"{rank}:{iteration}":
        return None
    from torch.distributed.checkpoint import FileSystemWriter   # heavy: only under the test hook

    class DyingWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            future.wait()
            print(f"rank {rank}: exiting in the middle of saving {d.name} "
                  f"(MPU_LAB_FAULT_IN_SAVE={fault})", flush=True)
            os._exit(3)

    return DyingWriter(str(d))


def save_checkpoint(save_dir, state) -> pathlib.Path:
    """Save ``state`` (a :class:`mpu_lab.training.TrainState`) as
    ``save_dir/iter_XXXXXXX``. Collective: every rank calls it. Returns the folder."""
    import torch.distributed.checkpoint as dcp   # heavy (about a second): only when saving
    it = state.iteration
    d = iteration_dir(save_dir, it)
    rank = dist.get_rank()
    if rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        (d / MARKER).unlink(missing_ok=True)   # re-saving: not complete until confirmed again
    dist.barrier()

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    sd: Dict[str, Any] = {}
    names = {}
    for name, p in _named_params(state.model):
        sd[f"model.{name}"] = _as_saved(p.detach().cpu(), p)
        names[p] = name
    has_optimizer = False
    for p, st in _optimizer_states(state.optimizer).items():
        if p in names and st:
            has_optimizer = True
            name = names[p]
            sd[f"optimizer.{name}.exp_avg"] = _as_saved(st["exp_avg"].detach().cpu(), p)
            sd[f"optimizer.{name}.exp_avg_sq"] = _as_saved(st["exp_avg_sq"].detach().cpu(), p)
            sd[f"optimizer.{name}.step"] = torch.as_tensor(st["step"]).detach().cpu().reshape(())
    sd.update(_rng_state_dict(f"rng.pp{pp_rank}.tp{tp_rank}"))
    # Small objects as JSON text: DCP would flatten a dict into one entry per key.
    sd["scheduler"] = json.dumps(state.scheduler.state_dict())
    sd["iteration"] = it
    sd["args"] = json.dumps(_jsonable_args(state.args))
    dcp.save(sd, checkpoint_id=str(d), storage_writer=_fault_writer(d, rank, it))
    dist.barrier()

    if rank == 0:
        args = state.args
        info = dict(iteration=it, complete=True, format="mpu_lab/dcp-1",
                    tensor_model_parallel_size=args.tensor_model_parallel_size,
                    pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                    virtual_pipeline_model_parallel_size=getattr(
                        args, "virtual_pipeline_model_parallel_size", None),
                    data_parallel_size=parallel_state.get_data_parallel_world_size(),
                    sequence_parallel=bool(args.sequence_parallel),
                    has_optimizer=has_optimizer, model=model_fields(args),
                    vocab_size=args.vocab_size, seq_length=args.seq_length,
                    torch_version=torch.__version__,
                    saved_at=datetime.datetime.now().isoformat(timespec="seconds"),
                    files=file_records(d))
        tmp = d / (MARKER + ".tmp")
        tmp.write_text(json.dumps(info, indent=1))
        tmp.replace(d / MARKER)
        tracker = pathlib.Path(save_dir) / TRACKER
        tracker.with_suffix(".tmp").write_text(str(it))
        tracker.with_suffix(".tmp").replace(tracker)
    dist.barrier()
    return d


def _optimizer_states(optimizer) -> Dict[torch.nn.Parameter, Dict[str, Any]]:
    """Each parameter's Adam state, whole: the plain optimizer's own, or the distributed
    optimizer's shards assembled over the data-parallel group (collective), so a checkpoint
    has one layout and loads at any data-parallel size."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.full_state()
    return dict(optimizer.state.items())


def _optimized_params(optimizer, names) -> List[torch.nn.Parameter]:
    """The model parameters an optimizer updates (the distributed optimizer's shards belong to
    parameters of the model: all of them, since every rank keeps every whole state here)."""
    if isinstance(optimizer, DistributedOptimizer):
        return list(names)
    return [q for g in optimizer.param_groups for q in g["params"]]


def load_checkpoint(path, model, optimizer=None, scheduler=None, load_rng: bool = True,
                    args=None) -> Dict[str, Any]:
    """Load a checkpoint saved at any tensor- and pipeline-parallel size into ``model`` (a
    module or a list of pipeline model chunks; and ``optimizer``, ``scheduler``). Collective.
    Returns the marker's info plus ``path``.

    Checks first, naming what is wrong: missing/partial folder, model shape (``args``), and
    every parameter's global shape against the checkpoint's metadata. The one shape that may
    differ is the vocabulary padding (it depends on TP): the embedding table, an untied output
    layer and their Adam moments are then read whole and re-padded
    (:mod:`~mpu_lab.checkpointing.vocab_padding`: dummy rows trimmed or added as zeros); the
    returned info says so under ``vocab_padding``.
    """
    import torch.distributed.checkpoint as dcp   # heavy (about a second): only when loading
    from torch.distributed.checkpoint import FileSystemReader
    d = verify_checkpoint(path)
    info = read_checkpoint_info(d)
    info["path"] = str(d)
    if args is not None:
        check_compatible(info, args)
    saved = FileSystemReader(str(d)).read_metadata().state_dict_metadata

    sd: Dict[str, Any] = {}
    targets = []   # (key, buffer, destination tensor, rows of a re-padded table or None)
    problems: List[str] = []
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    repadded: Dict[str, tuple] = {}

    def want(key, param, dest):
        meta = saved.get(key)
        shape = _global_shape(param, dest.shape)
        if meta is None:
            problems.append(f"{key} is not in the checkpoint")
            return
        size = tuple(getattr(meta, "size", ()))
        rows = None
        if size != tuple(shape):
            if not (hasattr(meta, "size") and vocab_padding.can_repad(
                    key, size, shape, info.get("vocab_size"))):
                problems.append(f"{key}: checkpoint shape {size}, model shape {tuple(shape)}")
                return
            # Another vocabulary padding: read the whole saved table, keep this rank's rows.
            rows = vocab_padding.rows_of(param, dest.shape[0], tp_rank, _is_split(param))
            repadded[key] = (size[0], shape[0])
        if key in buffers:   # one rank holding a tensor and its copy: read it once
            targets.append((key, buffers[key], dest, rows))
            return
        buf = torch.empty(dest.shape if rows is None else size, dtype=meta.properties.dtype)
        buffers[key] = buf
        sd[key] = _as_saved(buf, param) if rows is None else buf
        targets.append((key, buf, dest, rows))

    buffers: Dict[str, torch.Tensor] = {}
    # the distributed optimizer's whole per-parameter states, read here, then sharded
    sharded: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]] = {}
    is_sharded = isinstance(optimizer, DistributedOptimizer)
    names = {}
    for name, p, _ in checkpoint_names(model):
        names[p] = name
        want(f"model.{name}", p, p.data)
    held = set(_pipeline_union(sorted(set(names.values()))))
    extra = sorted(k[len("model."):] for k in saved if k.startswith("model.")
                   and k[len("model."):] not in held)
    if extra:
        problems.append(f"the checkpoint has parameters this model lacks: {extra}")
    if optimizer is not None:
        if not info.get("has_optimizer", False):
            problems.append("the checkpoint has no optimizer state (pass --no-load-optim)")
        else:
            for p in _optimized_params(optimizer, names):
                st = sharded.setdefault(p, {}) if is_sharded else optimizer.state[p]
                if not st:   # AdamW creates its state lazily: make it now, then fill it
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                want(f"optimizer.{names[p]}.exp_avg", p, st["exp_avg"])
                want(f"optimizer.{names[p]}.exp_avg_sq", p, st["exp_avg_sq"])
                key = f"optimizer.{names[p]}.step"
                if key in saved and key not in sd:
                    sd[key] = torch.zeros((), dtype=torch.float32)
    if problems:
        raise CheckpointError(f"checkpoint {d} does not fit this model: " + "; ".join(problems))

    same_tp = info.get("tensor_model_parallel_size") == \
        parallel_state.get_tensor_model_parallel_world_size()
    same_pp = info.get("pipeline_model_parallel_size", 1) == \
        parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if any(k.startswith("rng.pp") for k in saved):
        rng_prefix = f"rng.pp{pp_rank if same_pp else 0}.tp{tp_rank if same_tp else 0}"
    else:   # written before pipeline parallelism: one stage
        rng_prefix = f"rng.tp{tp_rank if same_tp else 0}"
    rng_keys = [k for k in saved if k.startswith(rng_prefix + ".")] if load_rng else []
    if not (same_tp and same_pp):
        # The tensor-parallel streams are per rank and cannot be mapped to other sizes: they
        # are reseeded instead; the default generator is taken from the first stage.
        rng_keys = [k for k in rng_keys if ".tracker." not in k]
    for k in rng_keys:
        sd[k] = torch.empty(saved[k].size, dtype=saved[k].properties.dtype)
    for k in ("scheduler", "iteration"):
        sd[k] = None

    dcp.load(sd, checkpoint_id=str(d))

    with torch.no_grad():
        for key, buf, dest, rows in targets:
            if rows is not None:
                buf = vocab_padding.repadded_rows(buf, *rows)
            dest.copy_(buf.to(dest.device))
    if repadded:
        saved_rows, rows_now = next(iter(repadded.values()))
        info["vocab_padding"] = dict(vocab_size=info["vocab_size"], saved=saved_rows,
                                     now=rows_now)
        if dist.get_rank() == 0:
            print("> " + vocab_padding.describe(info["vocab_size"], saved_rows, rows_now),
                  flush=True)
    if optimizer is not None:
        for p in _optimized_params(optimizer, names):
            key = f"optimizer.{names[p]}.step"
            if key in sd:
                (sharded[p] if is_sharded else optimizer.state[p])["step"].copy_(sd[key])
        if is_sharded:   # the distributed optimizer keeps its data-parallel shard of each state
            optimizer.load_full_state(sharded)
    if scheduler is not None and sd.get("scheduler") is not None:
        scheduler.load_state_dict(json.loads(sd["scheduler"]))
    if rng_keys:
        torch.set_rng_state(sd[f"{rng_prefix}.cpu"])
        device = distributed.get_device()
        if device.type == "cuda" and f"{rng_prefix}.cuda" in sd:
            torch.cuda.set_rng_state(sd[f"{rng_prefix}.cuda"], device)
        if same_tp and same_pp:
            tracker = get_rng_tracker()
            states = tracker.get_states()
            for name in list(states):
                cpu = sd.get(f"{rng_prefix}.tracker.{name}.cpu")
                cuda = sd.get(f"{rng_prefix}.tracker.{name}.cuda")
                if cpu is not None:
                    states[name] = (cpu, cuda if cuda is not None else states[name][1])
            tracker.set_states(states)
    info["iteration"] = int(sd["iteration"]) if sd.get("iteration") is not None else info["iteration"]
    return info
