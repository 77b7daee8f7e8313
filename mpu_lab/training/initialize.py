"""Start ``torch.distributed`` the way every ``launch/`` script and test does (backend, device,
timeout): Megatron-LM's ``megatron/training/initialize.py``, ``_initialize_distributed``.

The rule, so the same script runs on a laptop CPU, one shared GPU or one GPU per rank:

* every local rank has a GPU of its own  -> NCCL, ``cuda:LOCAL_RANK``;
* more local ranks than GPUs (one GPU shared by several ranks) -> gloo, ``cuda:LOCAL_RANK % n``;
  NCCL would refuse with "Duplicate GPU detected";
* no GPU -> gloo on the CPU.

The collective timeout is short (60 s by default, ``MPU_LAB_TIMEOUT_S`` overrides) so a lab
whose ranks disagree fails in a minute instead of NCCL's 10 or gloo's 30.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from typing import Optional

import torch
import torch.distributed as dist

from mpu_lab.core import parallel_state
from mpu_lab.core.utils import get_device, set_device

DEFAULT_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device


def choose_backend(local_world_size: int, gpu_count: Optional[int] = None) -> str:
    """``"nccl"`` when each of ``local_world_size`` ranks gets its own GPU, else ``"gloo"``."""
    if gpu_count is None:
        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpu_count >= 1 and local_world_size <= gpu_count and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def choose_device(local_rank: int, gpu_count: Optional[int] = None) -> torch.device:
    """The device of a local rank: its own GPU, a shared GPU (round-robin), or the CPU."""
    if gpu_count is None:
        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpu_count == 0:
        return torch.device("cpu")
    return torch.device("cuda", local_rank % gpu_count)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now, for a rendezvous (``MASTER_PORT``). The operating
    system picks it; another process may still take it before the rendezvous binds it."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def synchronize(device) -> None:
    """Wait until the kernels queued on ``device`` have run (nothing to wait for on the CPU):
    a wall-clock time read after a CUDA launch would otherwise measure the launch only."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def init(backend: str = "auto", timeout_s: Optional[float] = None, device: Optional[str] = None,
         store=None) -> DistInfo:
    """Initialise the default process group from torchrun's environment variables (or, given a
    ``store``, with it as the rendezvous: :func:`init_single_process`'s world of one).

    ``backend``: ``"auto"`` (the rule above), ``"gloo"`` or ``"nccl"``; the environment variable
    ``MPU_LAB_BACKEND`` overrides ``"auto"``. ``device``: ``"cpu"`` forces CPU tensors even when
    a GPU is present (``MPU_LAB_DEVICE`` likewise). Calling it twice returns the same info.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            "RANK / WORLD_SIZE are not set: start this script with torchrun, e.g. "
            "`torchrun --standalone --nproc-per-node 4 script.py`, or from a notebook with "
            "mpu_lab.launcher.run(...)"
        )
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if timeout_s is None:
        timeout_s = float(os.environ.get("MPU_LAB_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    device = device or os.environ.get("MPU_LAB_DEVICE")
    gpu_count = 0 if device == "cpu" else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if backend == "auto":
        backend = os.environ.get("MPU_LAB_BACKEND", "auto")
    if backend == "auto":
        backend = choose_backend(local_world_size, gpu_count)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and local_world_size > gpu_count:
        raise ValueError(
            f"backend 'nccl' needs one GPU per local rank: {local_world_size} local ranks but "
            f"{gpu_count} GPU(s) visible; use backend='gloo' (or 'auto') to share GPUs"
        )
    dev = choose_device(local_rank, gpu_count)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        kwargs = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        if backend == "nccl":
            kwargs["device_id"] = dev
        if store is not None:
            kwargs.update(store=store, rank=rank, world_size=world_size)
        dist.init_process_group(**kwargs)
    # Megatron's groups get the same short timeout, not torch's 30-minute default for new groups
    parallel_state.set_default_timeout(datetime.timedelta(seconds=timeout_s))
    info = DistInfo(rank, world_size, local_rank, local_world_size, dist.get_backend(), dev)
    global _INFO
    _INFO = info
    set_device(dev)
    return info


_INFO: Optional[DistInfo] = None


def shutdown():
    """Tear down the default group (idempotent). Call it on success only: a failing rank
    should exit at once, because ``destroy_process_group`` can block on dead peers."""
    global _INFO
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _INFO = None
    set_device(None)


def init_single_process(backend: str = "auto"):
    """A one-rank ``torch.distributed`` world and TP=1 groups in this very process (a notebook,
    a benchmark, a unit test). Does nothing when a world already exists. Outside torchrun its
    rendezvous is an in-process ``HashStore``: a TCP port chosen free and bound later could be
    taken in between by another job on the machine (seen under the full suite: EADDRINUSE, and
    every later call retried the same port)."""
    if not dist.is_initialized():
        store = None
        # not under torchrun: no environment yet, or ours from an earlier world of one
        if "RANK" not in os.environ or ("MASTER_ADDR" not in os.environ
                                        and os.environ.get("WORLD_SIZE") == "1"):
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
            store = dist.HashStore()
        init(backend=backend, store=store)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


__all__ = ["DEFAULT_TIMEOUT_S", "DistInfo", "choose_backend", "choose_device", "free_port",
           "synchronize", "init", "get_device", "shutdown", "init_single_process"]
