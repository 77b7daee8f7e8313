"""The patches that let Megatron-core's CUDA-minded code run on a CPU under gloo.

Applied only inside a process that runs Megatron-core (a ``launch/`` script's ranks), never in
a learner's kernel, and undone when the ``with`` block ends::

    with megatron_core_cpu.cpu_patches():
        ddp = megatron.core.distributed.DistributedDataParallel(...)

Each patch is named, with the one-line reason it is needed (checked with megatron-core 0.16.1
and 0.19.2 by switching each off). On a GPU rank nothing is patched.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Callable, Dict, Iterator, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

from mpu_lab.training import initialize
from mpu_lab import launcher

# Expected noise in a side-by-side job, hidden: Megatron-core warns that
# CUDA_DEVICE_MAX_CONNECTIONS is unset (a speed hint for GPUs) and calls torch collectives that
# recent torch marks deprecated.
EXPECTED_WARNINGS = (".*CUDA_DEVICE_MAX_CONNECTIONS.*", ".*is deprecated.*")


def start_job(missing: Optional[str], more_warnings: Sequence[str] = ()) -> Optional[int]:
    """The start every ``launch/megatron_core_*.py`` rank shares: where Megatron-core is
    ``missing`` (its install hint, :func:`mpu_lab.megatron_reference.runtime.missing`), report
    ``{"skipped": hint}``, print the hint on rank 0 and return ``None``; otherwise hide the
    expected warnings, initialise ``torch.distributed`` and return this rank."""
    rank = int(os.environ.get("RANK", "0"))
    if missing is not None:
        launcher.report({"rank": rank, "skipped": missing})
        if rank == 0:
            print(missing)
        return None
    for message in EXPECTED_WARNINGS + tuple(more_warnings):
        warnings.filterwarnings("ignore", message=message)
    initialize.init()
    return rank


class _NoOpStream:
    """Stands in for ``torch.cuda.Stream`` / ``Event``: the CPU has one stream, in order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        return None

    def wait_event(self, *args, **kwargs):
        return None

    def record_event(self, *args, **kwargs):
        return _NoOpStream()

    def record(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def wait(self, *args, **kwargs):
        return None

    def query(self):
        return True


# name in torch.cuda -> (stand-in, why Megatron-core needs it on a CPU)
CUDA_STAND_INS: Dict[str, tuple] = {
    "current_device": (lambda: torch.device("cpu"),
                       "its buffers and flags are allocated on torch.cuda.current_device()"),
    "Stream": (_NoOpStream, "DDP and the schedules make side streams for communication"),
    "Event": (_NoOpStream, "the schedules and the optimizer record events to order streams"),
    "current_stream": (lambda *a, **k: _NoOpStream(), "stream waits before a collective"),
    "default_stream": (lambda *a, **k: _NoOpStream(), "stream waits after a collective"),
    "stream": (lambda *a, **k: contextlib.nullcontext(), "collectives run inside a stream context"),
    "synchronize": (lambda *a, **k: None, "called before timers and after buffer frees"),
}


class CudaArgumentsToCpu(TorchFunctionMode):
    """Rewrites what Megatron-core's optimizer and schedules ask of the GPU, for CPU tensors:

    * ``device="cuda"`` (or a CUDA device) in a factory call -> the CPU: the optimizer makes
      its found-inf flag and scale on ``device='cuda'``;
    * ``tensor.type()`` of a CPU float tensor -> its ``torch.cuda.`` name: the distributed
      optimizer accepts only ``'torch.cuda.FloatTensor'`` (and half / bf16) parameters;
    * ``tensor.cuda()`` -> the tensor itself: the optimizer's state loading moves tensors back.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if not name.startswith("torch.") or ".cuda." in name \
                else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_patches(on_cpu: bool = True) -> Iterator[Dict[str, str]]:
    """While inside: the ``torch.cuda`` stand-ins of :data:`CUDA_STAND_INS` and
    :class:`CudaArgumentsToCpu`; yields ``{patch: reason}``. ``on_cpu=False`` (a GPU rank)
    patches nothing."""
    if not on_cpu:
        yield {}
        return
    saved: Dict[str, Callable] = {}
    try:
        for name, (stand_in, _) in CUDA_STAND_INS.items():
            saved[name] = getattr(torch.cuda, name)
            setattr(torch.cuda, name, stand_in)
        with CudaArgumentsToCpu():
            yield {f"torch.cuda.{n}": why for n, (_, why) in CUDA_STAND_INS.items()} | {
                "device='cuda', .type(), .cuda()": "the optimizer allocates and checks on the GPU"}
    finally:
        for name, original in saved.items():
            setattr(torch.cuda, name, original)


@contextlib.contextmanager
def megatron_fsdp_patches(on_cpu: bool = True) -> Iterator[Dict[str, str]]:
    """While inside, :func:`cpu_patches` and what Megatron-core's Megatron-FSDP needs besides
    (0.16.1 and 0.19.2): ``torch.cuda.current_device()`` returns 0, because
    ``MegatronFSDP.__init__`` builds ``f"cuda:{current_device()}"`` (its tensors still land on
    the CPU through :class:`CudaArgumentsToCpu`). Yields ``{patch: reason}``;
    ``on_cpu=False`` patches nothing."""
    if not on_cpu:
        yield {}
        return
    with cpu_patches() as reasons:
        saved = torch.cuda.current_device
        setattr(torch.cuda, "current_device", lambda: 0)
        try:
            yield dict(reasons, **{"torch.cuda.current_device": "MegatronFSDP names cuda:<n>"})
        finally:
            setattr(torch.cuda, "current_device", saved)


@contextlib.contextmanager
def moe_patches(on_cpu: bool = True) -> Iterator[Dict[str, str]]:
    """While inside, what Megatron-core's MoE layer needs on a CPU besides :func:`cpu_patches`
    (0.16.1 and 0.19.2); yields ``{patch: reason}``. ``on_cpu=False`` patches nothing."""
    if not on_cpu:
        yield {}
        return
    # megatron-core is optional: its MoE modules are imported only where they are patched.
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def to_host(tensor, as_numpy=False, record_stream=False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    saved = {"to_host": token_dispatcher.maybe_move_tensor_to_cpu,
             "gemm": getattr(moe_utils, "te_general_gemm", "absent")}
    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    if saved["gemm"] == "absent":
        moe_utils.te_general_gemm = None
    try:
        yield {"token_dispatcher.maybe_move_tensor_to_cpu":
               "the all-to-all dispatcher wants its split sizes as numpy, which only its "
               "device-to-host copy makes",
               "moe_utils.te_general_gemm = None":
               "0.16's router gate reads it, undefined without Transformer Engine"}
    finally:
        token_dispatcher.maybe_move_tensor_to_cpu = saved["to_host"]
        if saved["gemm"] == "absent":
            del moe_utils.te_general_gemm
