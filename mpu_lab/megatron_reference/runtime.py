"""Megatron-core itself, imported beside the mirror where ``megatron-core`` is installed.

Megatron-core is optional (Linux x86_64 wheels; 0.17 on need Python >= 3.12, so 3.10 and 3.11
get 0.16.x); checked with 0.16.1 and 0.19.2. Where it cannot be imported :func:`available` is
False and :func:`missing` says how to get it; nothing else in mpu_lab needs it.

Rank side (inside a torchrun worker or a playground engine, with mpu_lab's groups already
made): :func:`initialize` builds Megatron-core's parallel state on the same world and
:func:`destroy` tears both libraries' state down. The side-by-side checks
(:mod:`~mpu_lab.megatron_reference.layers`, ``ddp``, ``moe``, ``schedules``) start from here.
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

INSTALL_HINT = ("megatron-core is not installed, so the side-by-side check with Megatron-core "
                "is skipped. It is optional: `pip install megatron-core` (Linux x86_64 wheels, "
                "Python >= 3.10, torch >= 2.6) adds it; everything else works without it.")
TRITON_HINT = ("megatron-core {version} is installed, but from 0.17 on `import megatron.core` "
               "imports triton, which is not installed here (the CPU build of torch does not "
               "bring it), so the side-by-side check with Megatron-core is skipped. It is "
               "optional: `pip install triton` (Linux x86_64) adds it; everything else works "
               "without it.")


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


def import_megatron():
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
    mps = import_megatron()[0]
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
