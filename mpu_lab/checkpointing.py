"""Distributed checkpoints with resharding, through ``torch.distributed.checkpoint`` (DCP).

Each tensor-parallel shard is saved as a ``DTensor`` over the tensor-parallel group
(``Shard(partition_dim)``): DCP records every shard with its *global* offsets, so a checkpoint
written at TP=2 can be read at TP=4 or TP=1 — each rank asks for the region it now owns and
DCP reads the overlapping pieces (the resharding of Megatron's ``dist_checkpointing``).

Pipeline stages save their layers under *global* layer numbers (``decoder.layers.<n>`` with
``n = layer_offset + i``, not the stage's local ``i``), so the keys are those of the one-stage
model whatever the pipeline size, and a checkpoint written at PP=2 loads at PP=1 or PP=4 the
same way. The last stage's copy of the tied embedding (``output_layer_weight``, marked
``shared``) is not saved: it is loaded from ``embedding.word_embeddings.weight``.
Replicated tensors (LayerNorms, position embedding, row-parallel biases) are plain tensors;
DCP writes one copy. Data-parallel replicas hold identical shards; DCP's planner writes each
once.

A checkpoint folder ``iter_0000100/`` holds DCP's data files and ``.metadata`` (written by
DCP only after every rank has written its data), then ``mpu_lab_checkpoint.json`` (written
by rank 0 after DCP returned: the "complete" marker, with the iteration, parallel sizes and
model shape, and the size and SHA-256 of every file DCP wrote). A folder without both is
incomplete — an interrupted save — and is never loaded; a file whose size or checksum differs
from the marker's is reported by name before anything is read (DCP itself keeps no
checksums: a flipped byte in a tensor would load silently). The parent folder gets Megatron's
``latest_checkpointed_iteration.txt``.

Test hook: ``MPU_LAB_FAULT_IN_SAVE=RANK:ITERATION`` makes that rank exit (``os._exit``) inside
DCP's save of that iteration, right after writing its data file — a rank killed mid-save.

What is saved: ``model.<name>`` (parameters), ``optimizer.<name>.{exp_avg,exp_avg_sq,step}``
(AdamW state, sharded like the parameter), ``scheduler``, ``iteration``, ``args``, and the RNG
states per pipeline and tensor-parallel rank (``rng.pp<k>.tp<r>.*``: the default generator and
the tracker's tensor-parallel stream; all restored when the TP and PP sizes are unchanged;
otherwise only the default generator of stage 0 / TP rank 0, and the streams are reseeded as
at start).

Command line::

    python -m mpu_lab.checkpointing info CHECKPOINT
    python -m mpu_lab.checkpointing consolidate CHECKPOINT model.pt    # one ordinary state_dict
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import pathlib
import re
import sys
import warnings
from typing import Any, Dict, List, Optional

import torch

MARKER = "mpu_lab_checkpoint.json"
TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "padded_vocab_size", "max_position_embeddings", "activation")


class CheckpointError(ValueError):
    """A missing, partial or mismatched checkpoint (the message says which and why)."""


def iteration_dir(save_dir, iteration: int) -> pathlib.Path:
    return pathlib.Path(save_dir) / f"iter_{iteration:07d}"


# --------------------------------------------------------------------------- finding (pure)
def incomplete_reason(directory) -> Optional[str]:
    """Why ``directory`` is not a complete checkpoint, or None if it is one."""
    d = pathlib.Path(directory)
    if not (d / ".metadata").is_file():
        return (f"incomplete checkpoint: {d} is partial: it has no .metadata, which DCP writes "
                f"last, so the save was interrupted")
    if not (d / MARKER).is_file():
        return (f"incomplete checkpoint: {d} is partial: DCP's .metadata is there but not "
                f"{MARKER}, so the save was interrupted before it was confirmed")
    return None


def _complete_siblings(d: pathlib.Path) -> List[str]:
    parent = d.parent
    return sorted(x.name for x in parent.iterdir() if x != d and x.is_dir()
                  and _ITER_DIR.match(x.name) and incomplete_reason(x) is None)


def _hint(d: pathlib.Path) -> str:
    """Where to go instead of ``d``: the parent folder picks the latest complete checkpoint."""
    others = _complete_siblings(d) if d.parent.is_dir() else []
    if not others:
        return ""
    return (f"; complete checkpoints beside it: {others} (--load {d.parent} picks the latest "
            f"complete one)")


def find_checkpoint(path) -> pathlib.Path:
    """The checkpoint folder ``path`` names: ``path`` itself, or the latest complete
    ``iter_XXXXXXX`` folder inside it. Raises :class:`CheckpointError` naming the problem."""
    p = pathlib.Path(path)
    if not p.exists():
        raise CheckpointError(f"no checkpoint at {p}: the path does not exist")
    if not p.is_dir():
        raise CheckpointError(f"no checkpoint at {p}: it is a file, not a checkpoint folder")
    if (p / ".metadata").exists() or (p / MARKER).exists() or _ITER_DIR.match(p.name):
        reason = incomplete_reason(p)
        if reason:
            raise CheckpointError(reason + _hint(p))
        return p
    iters = sorted(d for d in p.iterdir() if d.is_dir() and _ITER_DIR.match(d.name))
    if not iters:
        raise CheckpointError(f"no checkpoint in {p}: it holds neither DCP's .metadata nor "
                              f"iter_XXXXXXX folders")
    for d in reversed(iters):
        if incomplete_reason(d) is None:
            return d
    raise CheckpointError(f"no complete checkpoint in {p}: "
                          + "; ".join(incomplete_reason(d) for d in iters))


def _file_digest(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_records(directory) -> Dict[str, Dict[str, Any]]:
    """``{name: {"bytes", "sha256"}}`` for the files DCP wrote in ``directory`` (the data
    files and ``.metadata``; not the marker)."""
    d = pathlib.Path(directory)
    return {f.name: {"bytes": f.stat().st_size, "sha256": _file_digest(f)}
            for f in sorted(d.iterdir()) if f.is_file() and not f.name.startswith(MARKER)}


def verify_checkpoint(path) -> pathlib.Path:
    """:func:`find_checkpoint`, then check every file against the sizes and SHA-256 sums the
    marker recorded at save. Raises :class:`CheckpointError` naming the first damaged or
    missing file. A checkpoint from before the sums were recorded is only found."""
    d = find_checkpoint(path)
    info = read_checkpoint_info(d)
    for name, rec in sorted(info.get("files", {}).items()):
        f = d / name
        if not f.is_file():
            raise CheckpointError(f"corrupted checkpoint {d}: file {name} is missing (the save "
                                  f"wrote {rec['bytes']} bytes){_hint(d)}")
        size = f.stat().st_size
        if size != rec["bytes"]:
            raise CheckpointError(f"corrupted checkpoint {d}: file {name} has {size} bytes, the "
                                  f"save wrote {rec['bytes']} (truncated or overwritten){_hint(d)}")
        if _file_digest(f) != rec["sha256"]:
            raise CheckpointError(f"corrupted checkpoint {d}: file {name} does not match the "
                                  f"SHA-256 recorded at save (same size, changed bytes){_hint(d)}")
    return d


def read_checkpoint_info(path) -> Dict[str, Any]:
    """The marker's content: iteration, parallel sizes, model shape."""
    d = find_checkpoint(path)
    try:
        return json.loads((d / MARKER).read_text())
    except ValueError as exc:
        raise CheckpointError(f"{d / MARKER} is not valid JSON ({exc}): a damaged checkpoint") from exc


def model_fields(args) -> Dict[str, Any]:
    ffn = args.ffn_hidden_size if args.ffn_hidden_size is not None else 4 * args.hidden_size
    return dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                num_attention_heads=args.num_attention_heads, ffn_hidden_size=ffn,
                padded_vocab_size=args.padded_vocab_size,
                max_position_embeddings=args.max_position_embeddings
                if args.max_position_embeddings is not None else args.seq_length,
                activation=args.activation)


def check_compatible(info: Dict[str, Any], args) -> None:
    """Raise :class:`CheckpointError` listing every model field where the checkpoint and
    ``args`` (validated) differ. The parallel sizes may differ: that is resharding."""
    saved = info.get("model", {})
    now = model_fields(args)
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, this run {now[k]!r}"
             for k in MODEL_FIELDS if saved.get(k) != now[k]]
    if not diffs:
        return
    hint = ""
    if saved.get("padded_vocab_size") != now["padded_vocab_size"]:
        hint = (f" (the vocabulary is padded to a multiple of make_vocab_size_divisible_by x TP:"
                f" saved at TP={info.get('tensor_model_parallel_size')}, now TP="
                f"{args.tensor_model_parallel_size}; choose --make-vocab-size-divisible-by so "
                f"both give {saved.get('padded_vocab_size')})")
    raise CheckpointError(f"checkpoint {info.get('path', '')} does not fit this model: "
                          + "; ".join(diffs) + hint)


# --------------------------------------------------------------------------- state dicts
_MESHES: Dict[tuple, Any] = {}


def _tp_mesh():
    from torch.distributed.device_mesh import DeviceMesh

    from mpu_lab import parallel_state
    group = parallel_state.get_tensor_model_parallel_group()
    key = tuple(parallel_state.get_group_ranks("tp"))
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, "cpu")
    return _MESHES[key]


def _is_split(param) -> bool:
    from mpu_lab import parallel_state
    return bool(getattr(param, "tensor_model_parallel", False)) and \
        parallel_state.get_tensor_model_parallel_world_size() > 1


def _global_shape(param, local_shape) -> torch.Size:
    from mpu_lab import parallel_state
    shape = list(local_shape)
    if _is_split(param):
        if getattr(param, "partition_stride", 1) != 1:
            raise NotImplementedError("interleaved (stride > 1) shards cannot be saved as DTensors")
        shape[param.partition_dim] *= parallel_state.get_tensor_model_parallel_world_size()
    return torch.Size(shape)


def _as_saved(local: torch.Tensor, param):
    """``local`` (this rank's piece, on the CPU) as DCP should see it."""
    if not _is_split(param):
        return local
    from torch.distributed.tensor import DTensor, Shard
    shape = _global_shape(param, local.shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, _tp_mesh(), [Shard(param.partition_dim)], run_check=False,
                              shape=shape, stride=stride)


def _chunks(model) -> List[torch.nn.Module]:
    if isinstance(model, (list, tuple, torch.nn.ModuleList)):
        return list(model)
    return [model]


_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
TIED_EMBEDDING = "embedding.word_embeddings.weight"


def checkpoint_names(model) -> List[tuple]:
    """``(name, parameter, is_copy)`` for every parameter of ``model`` (a module, or a list of
    pipeline model chunks): the name the one-stage model gives it — layers numbered globally
    (their ``layer_number``) — and ``is_copy`` for the last stage's copy of the tied embedding,
    which is named like the embedding, loaded from it and never saved."""
    out = []
    for chunk in _chunks(model):
        for name, p in chunk.named_parameters():
            if getattr(p, "shared", False):
                out.append((TIED_EMBEDDING, p, True))
                continue
            match = _LAYER_NAME.match(name)
            if match:
                layer = chunk.decoder.layers[int(match.group(1))]
                number = getattr(layer, "layer_number", int(match.group(1)))
                name = f"decoder.layers.{number}.{match.group(2)}"
            out.append((name, p, False))
    return out


def _named_params(model):
    """The parameters to save, with their checkpoint names."""
    return [(n, p) for n, p, copy in checkpoint_names(model) if not copy]


def _pipeline_union(names: List[str]) -> List[str]:
    """The names held by the whole pipeline (every stage's), on every stage."""
    import torch.distributed as dist

    from mpu_lab import parallel_state
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return list(names)
    gathered: List[Any] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(gathered, list(names),
                           group=parallel_state.get_pipeline_model_parallel_group())
    return sorted({n for part in gathered for n in part})


def _rng_state_dict(prefix: str) -> Dict[str, torch.Tensor]:
    from mpu_lab import distributed
    from mpu_lab.tensor_parallel import get_rng_tracker
    out = {f"{prefix}.cpu": torch.get_rng_state()}
    device = distributed.get_device()
    if device.type == "cuda":
        out[f"{prefix}.cuda"] = torch.cuda.get_rng_state(device)
    for name, (cpu, cuda) in get_rng_tracker().get_states().items():
        out[f"{prefix}.tracker.{name}.cpu"] = cpu
        if cuda is not None:
            out[f"{prefix}.tracker.{name}.cuda"] = cuda
    return out


def _jsonable_args(args) -> Dict[str, Any]:
    out = {}
    for k, v in vars(args).items():
        if v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
        else:
            out[k] = str(v)
    return out


def _fault_writer(d: pathlib.Path, rank: int, iteration: int):
    """DCP's default writer, or — when ``MPU_LAB_FAULT_IN_SAVE`` is ``"<rank>:<iteration>"``
    for this rank and iteration — one that exits the process right after writing this rank's
    data file, before DCP's metadata: a rank killed mid-save (the reliability tests)."""
    fault = os.environ.get("MPU_LAB_FAULT_IN_SAVE", "")
    if fault != f"{rank}:{iteration}":
        return None
    from torch.distributed.checkpoint import FileSystemWriter

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
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from mpu_lab import parallel_state
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
    for p, st in state.optimizer.state.items():
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


def load_checkpoint(path, model, optimizer=None, scheduler=None, load_rng: bool = True,
                    args=None) -> Dict[str, Any]:
    """Load a checkpoint saved at any tensor- and pipeline-parallel size into ``model`` (a
    module or a list of pipeline model chunks; and ``optimizer``, ``scheduler``). Collective.
    Returns the marker's info plus ``path``.

    Checks first, naming what is wrong: missing/partial folder, model shape (``args``), and
    every parameter's global shape against the checkpoint's metadata.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from mpu_lab import distributed, parallel_state
    from mpu_lab.tensor_parallel import get_rng_tracker
    d = verify_checkpoint(path)
    info = read_checkpoint_info(d)
    info["path"] = str(d)
    if args is not None:
        check_compatible(info, args)
    saved = FileSystemReader(str(d)).read_metadata().state_dict_metadata

    sd: Dict[str, Any] = {}
    targets = []   # (key, buffer, destination tensor)
    problems: List[str] = []

    def want(key, param, dest):
        meta = saved.get(key)
        shape = _global_shape(param, dest.shape)
        if meta is None:
            problems.append(f"{key} is not in the checkpoint")
            return
        if not hasattr(meta, "size") or tuple(meta.size) != tuple(shape):
            problems.append(f"{key}: checkpoint shape {tuple(getattr(meta, 'size', ()))}, "
                            f"model shape {tuple(shape)}")
            return
        if key in buffers:   # one rank holding a tensor and its copy: read it once
            targets.append((key, buffers[key], dest))
            return
        buf = torch.empty(dest.shape, dtype=meta.properties.dtype)
        buffers[key] = buf
        sd[key] = _as_saved(buf, param)
        targets.append((key, buf, dest))

    buffers: Dict[str, torch.Tensor] = {}
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
            for p in [q for g in optimizer.param_groups for q in g["params"]]:
                st = optimizer.state[p]
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
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
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
        for key, buf, dest in targets:
            dest.copy_(buf.to(dest.device))
    if optimizer is not None:
        for p in [q for g in optimizer.param_groups for q in g["params"]]:
            key = f"optimizer.{names[p]}.step"
            if key in sd:
                optimizer.state[p]["step"].copy_(sd[key])
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


# --------------------------------------------------------------------------- gather / consolidate
def gather_model_state_dict(model, pipeline: bool = False) -> Dict[str, torch.Tensor]:
    """The full (TP=1) parameters of ``model`` (a module or a list of pipeline chunks) on every
    rank of the tensor-parallel group, on the CPU, with checkpoint names (global layer
    numbers). Collective over the tensor-parallel group. ``pipeline=True``: the whole
    model's, gathered over the pipeline group too (then collective over both)."""
    import torch.distributed as dist

    from mpu_lab import comm, parallel_state
    out = {}
    group = parallel_state.get_tensor_model_parallel_group()
    for name, p in _named_params(model):
        t = p.detach()
        if _is_split(p):
            t = comm.all_gather(t, group=group, dim=p.partition_dim)
        out[name] = t.cpu().clone()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pipeline and pp > 1:
        parts: List[Any] = [None] * pp
        dist.all_gather_object(parts, out, group=parallel_state.get_pipeline_model_parallel_group())
        out = {k: v for part in parts for k, v in part.items()}
    return out


def consolidate(path, out_file=None, include_optimizer: bool = False) -> Dict[str, torch.Tensor]:
    """Read a checkpoint (any TP size) into one ordinary ``state_dict`` with the TP=1 names of
    :class:`~mpu_lab.models.GPTModel` / :class:`~mpu_lab.models.PlainGPT`; save it with
    ``torch.save`` to ``out_file`` if given. Needs no ``torch.distributed``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    d = verify_checkpoint(path)
    saved = FileSystemReader(str(d)).read_metadata().state_dict_metadata
    prefixes = ("model.", "optimizer.") if include_optimizer else ("model.",)
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
          for k, m in saved.items() if k.startswith(prefixes) and hasattr(m, "size")}
    with warnings.catch_warnings():   # "torch.distributed is disabled ...": single process on purpose
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=str(d), no_dist=True)
    out = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in sd.items()}
    if out_file is not None:
        torch.save(out, out_file)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpu_lab.checkpointing",
                                     description="Inspect or consolidate an mpu_lab checkpoint.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="print the checkpoint's marker (iteration, sizes, model)")
    p.add_argument("checkpoint")
    p = sub.add_parser("consolidate", help="write one ordinary state_dict file (TP=1 names)")
    p.add_argument("checkpoint")
    p.add_argument("output")
    p.add_argument("--include-optimizer", action="store_true")
    a = parser.parse_args(argv)
    try:
        if a.command == "info":
            d = find_checkpoint(a.checkpoint)
            print(json.dumps(dict(read_checkpoint_info(d), path=str(d)), indent=1))
        else:
            sd = consolidate(a.checkpoint, a.output, a.include_optimizer)
            n = sum(t.numel() for k, t in sd.items() if not k.startswith("optimizer."))
            print(f"wrote {a.output}: {len(sd)} tensors, {n:,} model parameters")
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
