"""Saving and loading a :class:`~mpu_lab.training.TrainState` with ``torch.distributed.checkpoint``
(Megatron's ``save_checkpoint`` / ``load_checkpoint`` of ``megatron/training/checkpointing.py``):
collective, resharding across tensor- and pipeline-parallel sizes, the completeness marker
written by rank 0 after DCP returned, and every mismatch named before anything is read.
:func:`load_checkpoint` runs in named steps: ask for the model's tensors, the optimizer's and
the RNG states (every mismatch collected first), read, then copy and restore each part."""
from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state
from mpu_lab.core.distributed.fsdp import FullyShardedOptimizer, unsharded_parameters
from mpu_lab.core.optimizer import DistributedOptimizer
from mpu_lab.training.checkpointing.files import (
    MARKER, TRACKER, CheckpointError, check_compatible, file_records, iteration_dir, model_fields,
    read_checkpoint_info, verify_checkpoint)
from mpu_lab.training.checkpointing import vocab_padding
from mpu_lab.training.checkpointing.state_dict import (
    as_saved, is_split, global_shape, jsonable_args, named_params, pipeline_union, rng_state_dict,
    checkpoint_names)
from mpu_lab.core.tensor_parallel import get_rng_tracker

# optimizers holding this rank's shards of each state (whole states assembled to save)
_SHARDED = (DistributedOptimizer, FullyShardedOptimizer)


def save_checkpoint(save_dir, state, storage_writer=None) -> pathlib.Path:
    """Save ``state`` (a :class:`mpu_lab.training.TrainState`) as
    ``save_dir/iter_XXXXXXX``. Collective: every rank calls it. Returns the folder.

    ``storage_writer``: the ``torch.distributed.checkpoint`` ``StorageWriter`` that writes the
    files, as ``dcp.save`` takes it (DCP points it at the folder with ``reset``); None: DCP's
    ``FileSystemWriter``."""
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
    with unsharded_parameters(getattr(state, "ddp_chunks", ())):   # ZeRO-3: the whole parameters, for a while
        for name, p in named_params(state.model):
            sd[f"model.{name}"] = as_saved(p.detach().cpu(), p)
            names[p] = name
    has_optimizer = False
    for p, st in _optimizer_states(state.optimizer).items():
        if p in names and st:
            has_optimizer = True
            name = names[p]
            sd[f"optimizer.{name}.exp_avg"] = as_saved(st["exp_avg"].detach().cpu(), p)
            sd[f"optimizer.{name}.exp_avg_sq"] = as_saved(st["exp_avg_sq"].detach().cpu(), p)
            sd[f"optimizer.{name}.step"] = torch.as_tensor(st["step"]).detach().cpu().reshape(())
    sd.update(rng_state_dict(f"rng.pp{pp_rank}.tp{tp_rank}"))
    # Small objects as JSON text: DCP would flatten a dict into one entry per key.
    sd["scheduler"] = json.dumps(state.scheduler.state_dict())
    if getattr(state, "scaler", None) is not None:   # fp16: Megatron keeps it with the optimizer
        sd["grad_scaler"] = json.dumps(state.scaler.state_dict())
    sd["iteration"] = it
    sd["args"] = json.dumps(jsonable_args(state.args))
    dcp.save(sd, checkpoint_id=str(d), storage_writer=storage_writer)
    dist.barrier()

    if rank == 0:
        args = state.args
        info = dict(iteration=it, complete=True, format="mpu_lab/dcp-1",
                    tensor_model_parallel_size=args.tensor_model_parallel_size,
                    pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                    virtual_pipeline_model_parallel_size=getattr(
                        args, "virtual_pipeline_model_parallel_size", None),
                    data_parallel_size=parallel_state.get_data_parallel_world_size(),
                    expert_model_parallel_size=(
                        parallel_state.get_expert_model_parallel_world_size()),
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
    if isinstance(optimizer, _SHARDED):
        return optimizer.full_state()
    return dict(optimizer.state.items())


def _optimized_params(optimizer, names) -> List[torch.nn.Parameter]:
    """The model parameters an optimizer updates (the distributed optimizer's shards belong to
    parameters of the model: all of them, since every rank keeps every whole state here)."""
    if isinstance(optimizer, _SHARDED):
        return list(names)
    return [q for g in optimizer.param_groups for q in g["params"]]


@dataclasses.dataclass
class _Reads:
    """What :func:`load_checkpoint` asks DCP for: the state dict to fill (``sd``), where each
    read tensor then goes (``targets``: key, buffer, destination, rows of a re-padded table or
    None), and every mismatch found on the way (``problems``), all checked against the
    checkpoint's metadata (``saved``) before anything is read."""
    saved: Dict[str, Any]
    vocab_size: Any
    tp_rank: int
    sd: Dict[str, Any] = dataclasses.field(default_factory=dict)
    targets: List[tuple] = dataclasses.field(default_factory=list)
    problems: List[str] = dataclasses.field(default_factory=list)
    buffers: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    repadded: Dict[str, tuple] = dataclasses.field(default_factory=dict)

    def want(self, key: str, param, dest: torch.Tensor) -> None:
        """Read ``key`` into ``dest`` (``param``'s local piece, or its Adam moment)."""
        meta = self.saved.get(key)
        shape = global_shape(param, dest.shape)
        if meta is None:
            self.problems.append(f"{key} is not in the checkpoint")
            return
        size = tuple(getattr(meta, "size", ()))
        rows = None
        if size != tuple(shape):
            if not (hasattr(meta, "size") and vocab_padding.can_repad(
                    key, size, shape, self.vocab_size)):
                self.problems.append(f"{key}: checkpoint shape {size}, model shape {tuple(shape)}")
                return
            # Another vocabulary padding: read the whole saved table, keep this rank's rows.
            rows = vocab_padding.rows_of(param, dest.shape[0], self.tp_rank, is_split(param))
            self.repadded[key] = (size[0], shape[0])
        if key in self.buffers:   # one rank holding a tensor and its copy: read it once
            self.targets.append((key, self.buffers[key], dest, rows))
            return
        buf = torch.empty(dest.shape if rows is None else size, dtype=meta.properties.dtype)
        self.buffers[key] = buf
        self.sd[key] = as_saved(buf, param) if rows is None else buf
        self.targets.append((key, buf, dest, rows))


def _want_model(reads: _Reads, model) -> Dict[torch.nn.Parameter, str]:
    """Every parameter of ``model``; the checkpoint must hold no layer this model lacks.
    Returns each parameter's checkpoint name."""
    names = {}
    for name, p, _ in checkpoint_names(model):
        names[p] = name
        reads.want(f"model.{name}", p, p.data)
    held = set(pipeline_union(sorted(set(names.values()))))
    extra = sorted(k[len("model."):] for k in reads.saved if k.startswith("model.")
                   and k[len("model."):] not in held)
    if extra:
        reads.problems.append(f"the checkpoint has parameters this model lacks: {extra}")
    return names


def _want_optimizer(reads: _Reads, optimizer, names, info) -> Dict[torch.nn.Parameter, Dict]:
    """Each optimized parameter's Adam moments and step. Returns the distributed optimizer's
    whole per-parameter states, read here and sharded after (empty for the plain one, whose
    own state is filled in place)."""
    sharded: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]] = {}
    if not info.get("has_optimizer", False):
        reads.problems.append("the checkpoint has no optimizer state (pass --no-load-optim)")
        return sharded
    is_sharded = isinstance(optimizer, _SHARDED)
    for p in _optimized_params(optimizer, names):
        st = sharded.setdefault(p, {}) if is_sharded else optimizer.state[p]
        if not st:   # AdamW creates its state lazily: make it now, then fill it
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        reads.want(f"optimizer.{names[p]}.exp_avg", p, st["exp_avg"])
        reads.want(f"optimizer.{names[p]}.exp_avg_sq", p, st["exp_avg_sq"])
        key = f"optimizer.{names[p]}.step"
        if key in reads.saved and key not in reads.sd:
            reads.sd[key] = torch.zeros((), dtype=torch.float32)
    return sharded


def _want_rng(reads: _Reads, info, load_rng: bool) -> Tuple[str, List[str], bool]:
    """The RNG states to restore: this rank's when the TP and PP sizes are unchanged, else
    only the default generator of stage 0 / TP rank 0. Returns ``(prefix, keys, same sizes)``."""
    same_tp = info.get("tensor_model_parallel_size") == \
        parallel_state.get_tensor_model_parallel_world_size()
    same_pp = info.get("pipeline_model_parallel_size", 1) == \
        parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank, tp_rank = parallel_state.get_pipeline_model_parallel_rank(), reads.tp_rank
    if any(k.startswith("rng.pp") for k in reads.saved):
        prefix = f"rng.pp{pp_rank if same_pp else 0}.tp{tp_rank if same_tp else 0}"
    else:   # written before pipeline parallelism: one stage
        prefix = f"rng.tp{tp_rank if same_tp else 0}"
    keys = [k for k in reads.saved if k.startswith(prefix + ".")] if load_rng else []
    if not (same_tp and same_pp):
        # The tensor-parallel streams are per rank and cannot be mapped to other sizes: they
        # are reseeded instead; the default generator is taken from the first stage.
        keys = [k for k in keys if ".tracker." not in k]
    for k in keys:
        reads.sd[k] = torch.empty(reads.saved[k].size, dtype=reads.saved[k].properties.dtype)
    return prefix, keys, same_tp and same_pp


def _copy_read_tensors(reads: _Reads, info) -> None:
    """Each read tensor into its destination (re-padded tables: this rank's rows); a change of
    vocabulary padding is recorded in ``info`` and told once."""
    with torch.no_grad():
        for key, buf, dest, rows in reads.targets:
            if rows is not None:
                buf = vocab_padding.repadded_rows(buf, *rows)
            dest.copy_(buf.to(dest.device))
    if reads.repadded:
        saved_rows, rows_now = next(iter(reads.repadded.values()))
        info["vocab_padding"] = dict(vocab_size=info["vocab_size"], saved=saved_rows,
                                     now=rows_now)
        if dist.get_rank() == 0:
            print("> " + vocab_padding.describe(info["vocab_size"], saved_rows, rows_now),
                  flush=True)


def _restore_optimizer(optimizer, names, sharded, sd) -> None:
    is_sharded = isinstance(optimizer, _SHARDED)
    for p in _optimized_params(optimizer, names):
        key = f"optimizer.{names[p]}.step"
        if key in sd:
            (sharded[p] if is_sharded else optimizer.state[p])["step"].copy_(sd[key])
    if is_sharded:   # the distributed optimizer keeps its data-parallel shard of each state
        optimizer.load_full_state(sharded)


def _restore_rng(sd, prefix: str, same_sizes: bool) -> None:
    torch.set_rng_state(sd[f"{prefix}.cpu"])
    device = initialize.get_device()
    if device.type == "cuda" and f"{prefix}.cuda" in sd:
        torch.cuda.set_rng_state(sd[f"{prefix}.cuda"], device)
    if same_sizes:
        tracker = get_rng_tracker()
        states = tracker.get_states()
        for name in list(states):
            cpu = sd.get(f"{prefix}.tracker.{name}.cpu")
            cuda = sd.get(f"{prefix}.tracker.{name}.cuda")
            if cpu is not None:
                states[name] = (cpu, cuda if cuda is not None else states[name][1])
        tracker.set_states(states)


def load_checkpoint(path, model, optimizer=None, scheduler=None, load_rng: bool = True,
                    args=None, grad_scaler=None) -> Dict[str, Any]:
    """Load a checkpoint saved at any tensor- and pipeline-parallel size into ``model`` (a
    module or a list of pipeline model chunks; and ``optimizer``, ``scheduler``, the fp16
    ``grad_scaler``). Collective. Returns the marker's info plus ``path``, and under
    ``grad_scaler`` whether the scaler's state was loaded (a checkpoint saved without fp16 has
    none: the scaler keeps its fresh state, as Megatron's optimizer keeps it then).

    Checks first, naming what is wrong: missing/partial folder, model shape (``args``), and
    every parameter's global shape against the checkpoint's metadata. The one shape that may
    differ is the vocabulary padding (it depends on TP): the embedding table, an untied output
    layer and their Adam moments are then read whole and re-padded
    (:mod:`~mpu_lab.training.checkpointing.vocab_padding`: dummy rows trimmed or added as zeros); the
    returned info says so under ``vocab_padding``.
    """
    import torch.distributed.checkpoint as dcp   # heavy (about a second): only when loading
    from torch.distributed.checkpoint import FileSystemReader
    d = verify_checkpoint(path)
    info = read_checkpoint_info(d)
    info["path"] = str(d)
    if args is not None:
        check_compatible(info, args)
    reads = _Reads(saved=FileSystemReader(str(d)).read_metadata().state_dict_metadata,
                   vocab_size=info.get("vocab_size"),
                   tp_rank=parallel_state.get_tensor_model_parallel_rank())
    names = _want_model(reads, model)
    sharded = _want_optimizer(reads, optimizer, names, info) if optimizer is not None else {}
    if reads.problems:
        raise CheckpointError(f"checkpoint {d} does not fit this model: "
                              + "; ".join(reads.problems))
    rng_prefix, rng_keys, same_sizes = _want_rng(reads, info, load_rng)
    sd = reads.sd
    for k in ("scheduler", "iteration"):
        sd[k] = None
    scaler_saved = grad_scaler is not None and "grad_scaler" in reads.saved
    if scaler_saved:
        sd["grad_scaler"] = None

    dcp.load(sd, checkpoint_id=str(d))

    _copy_read_tensors(reads, info)
    if optimizer is not None:
        _restore_optimizer(optimizer, names, sharded, sd)
    if scheduler is not None and sd.get("scheduler") is not None:
        scheduler.load_state_dict(json.loads(sd["scheduler"]))
    if scaler_saved:
        grad_scaler.load_state_dict(json.loads(sd["grad_scaler"]))
    info["grad_scaler"] = scaler_saved
    if rng_keys:
        _restore_rng(sd, rng_prefix, same_sizes)
    info["iteration"] = int(sd["iteration"]) if sd.get("iteration") is not None else info["iteration"]
    return info
