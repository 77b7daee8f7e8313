"""mpu_lab side by side with the real Megatron-core, where ``megatron-core`` is installed.

Megatron-core is optional (Linux x86_64 wheels; 0.17 on need Python >= 3.12, so 3.10 and 3.11
get 0.16.x); checked with 0.16.1 and 0.19.2. Where it cannot be imported :func:`available` is
False and :func:`missing` says how to get it; nothing else in mpu_lab needs it.

Two halves, like :mod:`mpu_lab.core.parallel_state`:

* :func:`rank_groups_side_by_side` — pure Python, no processes: mpu_lab's
  :func:`~mpu_lab.core.parallel_state.generate_rank_groups` next to Megatron-core's
  ``parallel_state.RankGenerator`` for every family both have (lab 01; works on any CPU).
* Rank side (inside a torchrun worker or a playground engine, with mpu_lab's groups already
  made): :func:`initialize` builds Megatron-core's parallel state on the same world,
  :func:`compare_linear` runs Megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear``
  and mpu_lab's from the same master weight on the same input, forward and backward,
  :func:`compare_mappings` does the same for the communication mappings, and :func:`destroy`
  tears both libraries' state down. :func:`format_results` prints the per-rank numbers.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import inspect
import logging
import re
import sys
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from mpu_lab.core.utils import get_device
from mpu_lab.core import parallel_state as ps
from mpu_lab.core import tensor_parallel as tp

INSTALL_HINT = ("megatron-core is not installed, so the side-by-side check with Megatron-core "
                "is skipped. It is optional: `pip install megatron-core` (Linux x86_64 wheels, "
                "Python >= 3.10, torch >= 2.6) adds it; everything else works without it.")
TRITON_HINT = ("megatron-core {version} is installed, but from 0.17 on `import megatron.core` "
               "imports triton, which is not installed here (the CPU build of torch does not "
               "bring it), so the side-by-side check with Megatron-core is skipped. It is "
               "optional: `pip install triton` (Linux x86_64) adds it; everything else works "
               "without it.")

# mpu_lab's generate_rank_groups key -> the token string Megatron-core's RankGenerator.get_ranks
# takes (its initialize_model_parallel asks for exactly these). The names are the same by
# design; the two embedding families are not RankGenerator tokens: Megatron-core derives them
# from each "pp" group with default_embedding_ranks (first and last stage) and
# default_position_embedding_ranks (first stage).
TOKENS = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "dp-cp": "dp-cp", "tp-pp": "tp-pp",
          "tp-dp": "tp-dp", "tp-cp": "tp-cp", "tp-dp-cp": "tp-dp-cp",
          "embedding": "pp: first+last", "position-embedding": "pp: first"}

# The keys of a side-by-side report that hold a compare_linear result (_sp: sequence parallel).
LINEAR_KINDS = ("column", "column_sp", "row", "row_sp")

# The mappings compared by compare_mappings: name -> the function name both libraries use.
MAPPINGS = {
    "copy": "copy_to_tensor_model_parallel_region",
    "reduce": "reduce_from_tensor_model_parallel_region",
    "scatter": "scatter_to_tensor_model_parallel_region",
    "gather": "gather_from_tensor_model_parallel_region",
    "scatter_sp": "scatter_to_sequence_parallel_region",
    "gather_sp": "gather_from_sequence_parallel_region",
    "reduce_scatter_sp": "reduce_scatter_to_sequence_parallel_region",
}


def missing() -> Optional[str]:
    """Why ``megatron.core`` cannot be imported here and how to fix it (:data:`INSTALL_HINT`,
    :data:`TRITON_HINT`), or None when it can; checked without importing it. 0.19.2's package
    ``__init__`` reaches a triton kernel (``transformer/moe/ops/paged_stash.py``) without
    requiring triton."""
    try:
        if importlib.util.find_spec("megatron.core") is None:
            return INSTALL_HINT
    except (ImportError, ValueError):   # no top-level "megatron" package at all
        return INSTALL_HINT
    release = version()
    if needs_triton(release) and importlib.util.find_spec("triton") is None:
        return TRITON_HINT.format(version=release)
    return None


def needs_triton(release: Optional[str]) -> bool:
    """Whether megatron-core ``release`` ("0.19.2") imports triton on ``import megatron.core``:
    0.17 on (the first releases for Python >= 3.12 only)."""
    numbers = [int(n) for n in re.findall(r"\d+", release or "")[:2]]
    return len(numbers) == 2 and tuple(numbers) >= (0, 17)


def available() -> bool:
    """True when ``megatron.core`` can be imported (see :func:`missing`)."""
    return missing() is None


class NoCudaRuntimeNotice(logging.Filter):
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME=..." notice, which
    ``torch.utils.cpp_extension`` logs on import (megatron-core imports it) wherever a CUDA
    toolkit is present but no GPU is: a CUDA build of torch on a laptop, the build a fresh
    ``pip install -r requirements.txt`` gets. Nothing in the labs compiles an extension."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


def _megatron():
    """Import Megatron-core's parallel state, tensor parallel and config, or raise with
    :func:`missing`'s hint."""
    reason = missing()
    if reason is not None:
        raise ImportError(reason)
    with without_cuda_runtime_notice(), warnings.catch_warnings():
        # on import it warns that Transformer Engine / Apex are absent: expected here
        warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
        # 0.19 warns that absl-py (an optional logger of its hyper_comm_grid) is absent
        warnings.filterwarnings("ignore", message=".*absl.logging is not installed.*")
        # megatron-core is optional (and slow to import): imported only where it is used.
        from megatron.core import ModelParallelConfig, parallel_state, tensor_parallel
    return parallel_state, tensor_parallel, ModelParallelConfig


@contextlib.contextmanager
def without_cuda_runtime_notice():
    """While inside, ``torch.utils.cpp_extension``'s logger drops the notice
    (:class:`NoCudaRuntimeNotice`)."""
    log, notice = logging.getLogger("torch.utils.cpp_extension"), NoCudaRuntimeNotice()
    log.addFilter(notice)
    try:
        yield
    finally:
        log.removeFilter(notice)


def version() -> Optional[str]:
    """The installed megatron-core version, or None."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- pure: rank groups
def megatron_order(order: str, sizes: Dict[str, int]) -> str:
    """mpu_lab's ``order`` as Megatron-core spells it: every token, fastest first (the default
    ``tp-cp-ep-dp-pp`` is 0.19's; ``ep`` has size 1 in the dense generator, and 0.19's
    ``RankGenerator`` appends its ``gtp_remat`` dimension of size 1 itself)."""
    return "-".join(ps.parse_order(order, sizes))


def rank_groups_side_by_side(world_size: int, tp: int, pp: int, cp: int = 1,
                             order: str = ps.DEFAULT_ORDER) -> Dict[str, object]:
    """mpu_lab's rank groups next to Megatron-core's ``RankGenerator`` for the same world.

    Pure Python (no ``torch.distributed``). Returns ``{"order", "dp", "families": {key:
    {"token", "mpu_lab", "megatron_core", "equal"}}, "all_equal"}``; ``key`` is mpu_lab's
    name and ``token`` what Megatron-core's ``RankGenerator.get_ranks`` is asked (see
    :data:`TOKENS`).
    """
    mps = _megatron()[0]
    ours = ps.generate_rank_groups(world_size, tp, pp, cp, order)
    dp = ps.check_sizes(world_size, tp, pp, cp)
    mc_order = megatron_order(order, {"tp": tp, "cp": cp, "dp": dp, "pp": pp})
    gen = mps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=mc_order)
    theirs = {key: gen.get_ranks(token) for key, token in TOKENS.items() if ":" not in token}
    theirs["embedding"] = [mps.default_embedding_ranks(g) for g in theirs["pp"]]
    theirs["position-embedding"] = [mps.default_position_embedding_ranks(g) for g in theirs["pp"]]
    families = {key: {"token": TOKENS[key], "mpu_lab": ours[key], "megatron_core": theirs[key],
                      "equal": ours[key] == theirs[key]} for key in TOKENS}
    return {"order": mc_order, "dp": dp, "families": families,
            "all_equal": all(f["equal"] for f in families.values())}


def format_rank_groups(table: Dict[str, object], width: int = 60) -> str:
    """One line per family: mpu_lab key, RankGenerator token, equal?, the groups (shortened)."""
    lines = [f"order {table['order']} (dp={table['dp']}): mpu_lab key | Megatron-core token | "
             f"same groups | groups"]
    for key, fam in table["families"].items():
        groups = str(fam["mpu_lab"])
        groups = groups if len(groups) <= width else groups[:width - 4] + " ..."
        lines.append(f"  {key:<19}| {fam['token']:<15}| {'yes' if fam['equal'] else 'NO':<4}| "
                     f"{groups}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- rank side
_PATCH: Dict[str, Callable] = {}


def _patch_cuda_current_device_to_cpu() -> bool:
    """CPU patch (0.16 and 0.19), why: Megatron-core allocates its communication buffers on
    ``torch.cuda.current_device()``, which raises without a GPU; its maths and its gloo
    collectives need nothing else. Applied in the rank process only, where it computes on the
    CPU; :func:`destroy` undoes it. Returns whether the patch is in place."""
    if get_device().type == "cuda":
        return False
    if "current_device" not in _PATCH:
        _PATCH["current_device"] = torch.cuda.current_device
        torch.cuda.current_device = lambda: torch.device("cpu")
    return True


def _megatron_group_ranks(mps) -> Dict[str, List[int]]:
    """This rank's Megatron-core groups, by mpu_lab's family names."""
    getters = {"tp": mps.get_tensor_model_parallel_group,
               "pp": mps.get_pipeline_model_parallel_group,
               "dp": mps.get_data_parallel_group, "cp": mps.get_context_parallel_group,
               "dp-cp": lambda: mps.get_data_parallel_group(with_context_parallel=True),
               "tp-pp": mps.get_model_parallel_group}
    return {name: dist.get_process_group_ranks(get()) for name, get in getters.items()}


def initialize(order: str = ps.DEFAULT_ORDER) -> Dict[str, object]:
    """Build Megatron-core's parallel state on the running world with mpu_lab's sizes.

    Call it on every rank after ``mpu_lab.core.parallel_state.initialize_model_parallel`` (pass the
    same ``order``; a different one shows up as ``groups_equal: False``). Called again, it
    first tears down Megatron-core's previous state. The world already exists, so Megatron-core
    is asked not to make its extra gloo groups (``create_gloo_process_groups=False``). On a
    CPU rank :func:`_patch_cuda_current_device_to_cpu` is applied first. Returns which of this
    rank's groups are the same in both libraries (``{"groups_equal": bool, "groups": {...}}``).
    """
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("initialise mpu_lab first: parallel_state.initialize_model_parallel")
    mps = _megatron()[0]
    if mps.model_parallel_is_initialized():
        destroy(mpu_lab_too=False)
    cpu_patch = _patch_cuda_current_device_to_cpu()
    sizes = {"tp": ps.get_tensor_model_parallel_world_size(),
             "pp": ps.get_pipeline_model_parallel_world_size(),
             "cp": ps.get_context_parallel_world_size(), "dp": ps.get_data_parallel_world_size()}
    kwargs = {}
    if "create_gloo_process_groups" in inspect.signature(mps.initialize_model_parallel).parameters:
        kwargs["create_gloo_process_groups"] = False
    mps.initialize_model_parallel(
        tensor_model_parallel_size=sizes["tp"], pipeline_model_parallel_size=sizes["pp"],
        context_parallel_size=sizes["cp"], order=megatron_order(order, sizes), **kwargs)
    theirs = _megatron_group_ranks(mps)
    groups = {name: {"mpu_lab": ps.get_group_ranks(name), "megatron_core": ranks}
              for name, ranks in theirs.items()}
    return {"groups_equal": all(g["mpu_lab"] == g["megatron_core"] for g in groups.values()),
            "groups": groups, "cpu_patch": cpu_patch}


def destroy(mpu_lab_too: bool = True) -> None:
    """Tear down Megatron-core's parallel state (and mpu_lab's, unless ``mpu_lab_too=False``).

    Megatron-core's ``destroy_model_parallel`` leaves ``_EMBEDDING_GLOBAL_RANKS`` set
    (checked with 0.16.1), so ``is_rank_in_embedding_group`` would still answer from the old
    world; it (and ``_POSITION_EMBEDDING_GLOBAL_RANKS``) is cleared here too. The CPU patch of
    ``torch.cuda.current_device`` is undone. The default process group stays (that is
    ``mpu_lab.training.initialize.shutdown``'s job)."""
    mps = sys.modules.get("megatron.core.parallel_state")   # None: never imported, nothing to do
    if mps is not None:
        mps.destroy_model_parallel()
        for name in ("_EMBEDDING_GLOBAL_RANKS", "_POSITION_EMBEDDING_GLOBAL_RANKS"):
            if hasattr(mps, name):
                setattr(mps, name, None)
    if "current_device" in _PATCH:
        torch.cuda.current_device = _PATCH.pop("current_device")
    if mpu_lab_too:
        ps.destroy_model_parallel()


def _max_diff(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> float:
    if a is None and b is None:
        return 0.0
    return (a.detach().float() - b.detach().float()).abs().max().item()


def _sequence_shard(x: torch.Tensor, dim: int) -> torch.Tensor:
    t, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return x.chunk(t, dim=dim)[r].contiguous()


def compare_linear(kind: str, input_size: int = 64, output_size: int = 32, seq: int = 8,
                   batch: int = 2, sequence_parallel: bool = False,
                   seed: int = 1234) -> Dict[str, object]:
    """mpu_lab's and Megatron-core's ``kind`` ("column" / "row") parallel linear, side by side.

    Both are built under ``torch.manual_seed(seed)`` with the same ``init_method``; both build
    the full master weight on the CPU and keep this TP rank's slice (Megatron-core's with
    ``use_cpu_initialization=True``). ``same_init`` says whether Megatron-core's own shard
    already equals mpu_lab's; mpu_lab's shard is then copied into it anyway, so the rest
    compares the layers' computation. The same input ``[seq, batch, *]`` and output gradient
    go through both. Column: ``gather_output=True``; row: ``input_is_parallel=False``; with
    ``sequence_parallel`` the Megatron-LM pairing instead (column ``gather_output=False`` on a
    sequence shard, row ``input_is_parallel=True`` returning a sequence shard). Returns
    max |mpu_lab - Megatron-core| of output, input gradient, weight and bias gradients.
    """
    if kind not in ("column", "row"):
        raise ValueError(f"kind must be 'column' or 'row', got {kind!r}")
    _, mtp, ModelParallelConfig = _megatron()
    device = get_device()
    init = torch.nn.init.xavier_normal_
    t = ps.get_tensor_model_parallel_world_size()
    config = ModelParallelConfig(tensor_model_parallel_size=t, sequence_parallel=sequence_parallel,
                                 use_cpu_initialization=True, params_dtype=torch.float32)
    torch.manual_seed(seed)
    if kind == "column":
        ours = tp.ColumnParallelLinear(input_size, output_size, gather_output=not sequence_parallel,
                                       init_method=init, sequence_parallel=sequence_parallel,
                                       keep_master_weight_for_test=True)
        torch.manual_seed(seed)
        theirs = mtp.ColumnParallelLinear(input_size, output_size, config=config, init_method=init,
                                          bias=True, gather_output=not sequence_parallel)
    else:
        ours = tp.RowParallelLinear(input_size, output_size, input_is_parallel=sequence_parallel,
                                    init_method=init, sequence_parallel=sequence_parallel,
                                    keep_master_weight_for_test=True)
        torch.manual_seed(seed)
        theirs = mtp.RowParallelLinear(input_size, output_size, config=config, init_method=init,
                                       bias=True, input_is_parallel=sequence_parallel,
                                       skip_bias_add=False)
    same_init = torch.equal(theirs.weight.detach().cpu(), ours.weight.detach().cpu())
    with torch.no_grad():                     # the same shard of the same master weight
        theirs.weight.copy_(ours.weight.detach().cpu())
        theirs.bias.copy_(ours.bias.detach().cpu())
    theirs.to(device)

    torch.manual_seed(seed + 1)               # the same full input on every rank
    x = torch.randn(seq, batch, input_size).to(device)  # cpu: CPU RNG: same on any device
    if sequence_parallel:
        x = _sequence_shard(x, 0) if kind == "column" else _sequence_shard(x, -1)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, _ = ours(x_ours)
    y_theirs, _ = theirs(x_theirs)
    torch.manual_seed(seed + 2)
    dy = torch.randn(y_ours.shape).to(device)  # cpu: CPU RNG: same on any device
    y_ours.backward(dy)
    y_theirs.backward(dy)
    return {"tp_rank": ps.get_tensor_model_parallel_rank(), "same_init": same_init,
            "output_shape": list(y_ours.shape),
            "output": _max_diff(y_ours, y_theirs),
            "input_grad": _max_diff(x_ours.grad, x_theirs.grad),
            "weight_grad": _max_diff(ours.weight.grad, theirs.weight.grad),
            "bias_grad": _max_diff(ours.bias.grad, theirs.bias.grad)}


def compare_mappings(seq: int = 8, batch: int = 2, hidden: int = 16,
                     seed: int = 1234) -> Dict[str, Dict[str, float]]:
    """Every mapping of :data:`MAPPINGS`, mpu_lab's and Megatron-core's, on the same tensors.

    Each rank feeds its own input (seeded by ``seed`` and its rank, so the reductions add
    different numbers) of shape ``[seq, batch, hidden]`` — the full tensor for scatters and
    reduce-scatter, this rank's piece for gathers — and the same output gradient to both.
    Returns ``{name: {"forward": max|diff|, "backward": max|diff|}}``.
    """
    _, mtp, _ = _megatron()
    device = get_device()
    out = {}
    for i, (name, fn_name) in enumerate(MAPPINGS.items()):
        torch.manual_seed(seed + 1000 * i + dist.get_rank())
        x = torch.randn(seq, batch, hidden).to(device)  # cpu: CPU RNG: same on any device
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        ys = [getattr(lib, fn_name)(xi) for lib, xi in zip((tp, mtp), xs)]
        dy = torch.randn(ys[0].shape).to(device)  # cpu: CPU RNG: same on any device
        for y in ys:
            y.backward(dy)
        out[name] = {"forward": _max_diff(*ys), "backward": _max_diff(xs[0].grad, xs[1].grad),
                     "shape": [list(x.shape), list(ys[0].shape)]}
    return out


# --------------------------------------------------------------------------- the lab's table
def _num(v: float) -> str:
    return "0" if v == 0 else f"{v:.1e}"


def format_results(results: List[Dict[str, object]], what: Optional[str] = None) -> str:
    """The per-rank numbers of ``launch/megatron_core_side_by_side.py`` as small tables in rank
    order (``results``: ``launcher.run(...).results``). ``what``: "column", "row",
    "mappings" or None (all that the job ran)."""
    if results and "skipped" in results[0]:
        return results[0]["skipped"]
    first = results[0]
    lines = [f"megatron-core {first['megatron_core']} vs mpu_lab, tp={first['tp']}: "
             f"max |mpu_lab - Megatron-core| per rank (0 = bit-identical)"]
    lines.append("same rank groups on every rank: " +
                 ("yes" if all(r["groups_equal"] for r in results) else "NO"))
    for kind in LINEAR_KINDS:
        if kind in first and what in (None, kind.replace("_sp", "")):
            sp = " + sequence parallel" if kind.endswith("_sp") else ""
            lines.append(f"\n{kind.replace('_sp', '')} parallel linear{sp}:")
            lines.append("rank  tp rank  same init  output   input grad  weight grad  bias grad")
            for r in results:
                c = r[kind]
                same = "yes" if c["same_init"] else "no"
                lines.append(f"{r['rank']:<6}{c['tp_rank']:<9}{same:<11}"
                             f"{_num(c['output']):<9}{_num(c['input_grad']):<12}"
                             f"{_num(c['weight_grad']):<13}{_num(c['bias_grad'])}")
    if "mappings" in first and what in (None, "mappings"):
        names = list(first["mappings"])
        lines.append("\nmappings, forward / backward:")
        lines.append("rank  " + "  ".join(f"{n:<{max(len(n), 15)}}" for n in names))
        for r in results:
            cells = [f"{_num(m['forward'])} / {_num(m['backward'])}"
                     for m in r["mappings"].values()]
            lines.append((f"{r['rank']:<6}" + "  ".join(
                f"{c:<{max(len(n), 15)}}" for n, c in zip(names, cells))).rstrip())
    return "\n".join(lines)
