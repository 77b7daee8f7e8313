"""Finding and verifying checkpoint folders, pure (no ``torch``, no ``torch.distributed``): the
``iter_XXXXXXX`` layout and Megatron's ``latest_checkpointed_iteration.txt`` (as in
``megatron/training/checkpointing.py``), the completeness marker ``mpu_lab_checkpoint.json``
with every file's size and SHA-256 (this lab's addition: DCP keeps no checksums), and the
model-shape comparison that tells whether a checkpoint fits a run. The launcher's pre-check of
``--load`` runs these before any process starts."""
from __future__ import annotations

import hashlib
import json
import pathlib
import re
from typing import Any, Dict, List, Optional

MARKER = "mpu_lab_checkpoint.json"
TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "padded_vocab_size", "max_position_embeddings", "activation", "num_experts")


class CheckpointError(ValueError):
    """A missing, partial or mismatched checkpoint (the message says which and why)."""


def iteration_dir(save_dir, iteration: int) -> pathlib.Path:
    return pathlib.Path(save_dir) / f"iter_{iteration:07d}"


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
                activation=args.activation, num_experts=getattr(args, "num_experts", None))


def check_compatible(info: Dict[str, Any], args) -> None:
    """Raise :class:`CheckpointError` listing every model field where the checkpoint and
    ``args`` (validated) differ. The parallel sizes may differ: that is resharding. So may the
    vocabulary *padding* (a multiple of make_vocab_size_divisible_by x TP), as long as the real
    vocabulary is the same: the loader trims or zero-fills the dummy rows
    (:mod:`mpu_lab.training.checkpointing.vocab_padding`). A checkpoint that did not record its real
    vocabulary size must have the same padding."""
    saved = info.get("model", {})
    now = model_fields(args)
    real = info.get("vocab_size")
    fields = [k for k in MODEL_FIELDS if not (real is not None and k == "padded_vocab_size")]
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, this run {now[k]!r}"
             for k in fields if saved.get(k) != now[k]]
    hints = []
    if real is not None and real != args.vocab_size:
        diffs.insert(0, f"vocab_size: checkpoint {real!r}, this run {args.vocab_size!r}")
        hints.append(f"the real vocabulary (the token ids of the data) cannot change across a "
                     f"resume, only its padding: use --vocab-size {real}")
    if not diffs:
        return
    if real is None and saved.get("padded_vocab_size") != now["padded_vocab_size"]:
        hints.append(f"the vocabulary is padded to a multiple of make_vocab_size_divisible_by x "
                     f"TP: saved at TP={info.get('tensor_model_parallel_size')}, now TP="
                     f"{args.tensor_model_parallel_size}; this checkpoint does not record its real "
                     f"vocabulary size, so choose --make-vocab-size-divisible-by so both give "
                     f"{saved.get('padded_vocab_size')}")
    hint = f" ({'; '.join(hints)})" if hints else ""
    raise CheckpointError(f"checkpoint {info.get('path', '')} does not fit this model: "
                          + "; ".join(diffs) + hint)
