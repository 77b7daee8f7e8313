"""One ordinary state dict from a sharded model or checkpoint: :func:`gather_model_state_dict`
(the full TP=1 parameters of a live model, gathered over the tensor- and optionally the
pipeline-parallel group), :func:`consolidate` (a checkpoint of any TP size read in one process)
and the command line ``python -m mpu_lab.training.checkpointing info|consolidate`` (:func:`main`) — the
job of Megatron's ``tools/checkpoint/`` converters."""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from mpu_lab.core import comm, parallel_state
from mpu_lab.training.checkpointing.files import (
    CheckpointError, find_checkpoint, read_checkpoint_info, verify_checkpoint)
from mpu_lab.training.checkpointing.state_dict import is_split, named_params

def gather_model_state_dict(model, pipeline: bool = False) -> Dict[str, torch.Tensor]:
    """The full (TP=1) parameters of ``model`` (a module or a list of pipeline chunks) on every
    rank of the tensor-parallel group, on the CPU, with checkpoint names (global layer
    numbers). Collective over the tensor-parallel group. ``pipeline=True``: the whole
    model's, gathered over the pipeline group too (then collective over both)."""
    out = {}
    group = parallel_state.get_tensor_model_parallel_group()
    for name, p in named_params(model):
        t = p.detach()
        if is_split(p):
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
    :class:`~mpu_lab.core.models.gpt.GPTModel` / :class:`~mpu_lab.training.plain_gpt.PlainGPT`; save it with
    ``torch.save`` to ``out_file`` if given. Needs no ``torch.distributed``."""
    import torch.distributed.checkpoint as dcp   # heavy (about a second): only when reading
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
        os.makedirs(os.path.dirname(os.fspath(out_file)) or ".", exist_ok=True)
        torch.save(out, out_file)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpu_lab.training.checkpointing",
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
