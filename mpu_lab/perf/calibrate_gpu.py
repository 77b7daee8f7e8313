"""Calibrate the cost model on a GPU: GEMMs at the run's shapes, device memory, the cluster.

The GPU counterpart of the CPU calibration in :mod:`mpu_lab.perf.calibrate`. What is timed on
the device, and how:

* :func:`device_best_time` — the fastest of ``repeats`` calls after ``warmup`` calls. On CUDA
  each call is bracketed by two ``torch.cuda.Event(enable_timing=True)`` recorded on the
  current stream and read after ``Event.synchronize()``: a kernel launch returns before the
  kernel has run, so a host clock around it times the launch, not the work. On the CPU the
  host clock (``time.perf_counter``) is the right one.
* :func:`calibrate_gemm` — FLOP/s of the run's layer GEMMs
  (:func:`mpu_lab.perf.calibrate.layer_matmul_shapes`) in the training dtype, bfloat16 by
  default: the tensor cores' rate at *these* shapes, which for a small model is far below the
  datasheet peak.
* :func:`calibrate_device_memory` — bytes/s of a device-to-device copy (read + write), the
  memory-bound term's bandwidth.
* :func:`device_calibration` — both, on one device, with the GPU's name, memory and count;
  :func:`gpu_cluster_from` turns it and an all-reduce fit into a
  :class:`~mpu_lab.perf.cost_model.Cluster` (``calibrate.gpu_cluster`` runs the whole thing).

Ranks that share a GPU (``nproc`` ranks on fewer GPUs: :func:`mpu_lab.training.initialize.choose_device`
assigns them round-robin) share its FLOP/s and bandwidth: :func:`gpu_cluster_from` gives each
rank ``gpus / nproc`` of them (:func:`device_share`).
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from mpu_lab.perf.cost_model import Cluster

__all__ = ["cuda_available", "default_device", "device_best_time", "calibrate_gemm",
           "calibrate_device_memory", "device_calibration", "device_share", "gpu_cluster_from"]


def cuda_available() -> bool:
    """Whether this process can use a CUDA GPU (the automatic choice of branch)."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def default_device() -> torch.device:
    """``cuda:0`` where there is a GPU, else the CPU."""
    return torch.device("cuda", 0) if cuda_available() else torch.device("cpu")


def _cuda_call_seconds(fn: Callable, device: torch.device) -> float:
    """One call of ``fn`` timed on ``device``'s current stream by two CUDA events."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream(device)
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3          # elapsed_time is in milliseconds


def _host_call_seconds(fn: Callable, device: torch.device) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def device_best_time(fn: Callable, device: Optional[torch.device] = None, repeats: int = 10,
                     warmup: int = 3) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn`` on ``device`` (default
    :func:`default_device`), after ``warmup`` calls and a synchronisation (cuBLAS picks its
    algorithm and allocates its workspace on the first calls). CUDA: event timing; CPU: the
    host clock. The minimum, as in :func:`mpu_lab.perf.calibrate.calibrate_matmul`: slower
    calls measure whatever else ran."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    device = default_device() if device is None else torch.device(device)
    on_gpu = device.type == "cuda"
    for _ in range(warmup):
        fn()
    if on_gpu:
        torch.cuda.synchronize(device)
    timed = _cuda_call_seconds if on_gpu else _host_call_seconds
    return min(timed(fn, device) for _ in range(repeats))


def calibrate_gemm(shapes: Sequence[Tuple[int, int, int, int]], device=None,
                   dtype: str = "bfloat16", repeats: int = 10, warmup: int = 3) -> float:
    """Measured FLOP/s of the (batched) matmuls ``(batch, m, k, n)`` — the layer GEMMs of the
    run (:func:`mpu_lab.perf.calibrate.layer_matmul_shapes`) — in ``dtype`` on ``device``:
    total FLOPs (``2·batch·m·k·n`` each) over the sum of the fastest times of each shape."""
    device = default_device() if device is None else torch.device(device)
    dt = getattr(torch, dtype)
    flops = seconds = 0.0
    for batch, m, k, n in shapes:
        a = torch.randn(batch, m, k, dtype=dt, device=device)
        b = torch.randn(batch, k, n, dtype=dt, device=device)
        seconds += device_best_time(lambda: torch.bmm(a, b), device, repeats, warmup)
        flops += 2.0 * batch * m * k * n
    if not seconds > 0:
        raise ValueError("the GEMMs took no measurable time: give larger shapes")
    return flops / seconds


def calibrate_device_memory(device=None, numel: int = 1 << 26, dtype: str = "bfloat16",
                            repeats: int = 10, warmup: int = 3) -> float:
    """Bytes/s of ``y.copy_(x)`` on ``device`` over ``numel`` elements (each byte read once
    and written once: ``2 · numel · element size`` per copy). 2**26 bf16 values are 128 MiB,
    well past any GPU's L2 cache."""
    device = default_device() if device is None else torch.device(device)
    dt = getattr(torch, dtype)
    x = torch.randn(numel, dtype=dt, device=device)
    y = torch.empty(numel, dtype=dt, device=device)
    seconds = device_best_time(lambda: y.copy_(x), device, repeats, warmup)
    return 2.0 * numel * x.element_size() / seconds


def _gpu_facts(device: torch.device) -> Dict[str, object]:
    """Name, memory (bytes) and count of the GPUs; the CPU's stand-ins elsewhere."""
    if device.type != "cuda":
        return dict(device_name="cpu", memory_bytes=None, gpu_count=0)
    props = torch.cuda.get_device_properties(device)
    return dict(device_name=props.name, memory_bytes=float(props.total_memory),
                gpu_count=torch.cuda.device_count())


def device_calibration(shapes: Sequence[Tuple[int, int, int, int]], device=None,
                       dtype: str = "bfloat16", memory_numel: int = 1 << 26,
                       repeats: int = 10) -> Dict[str, object]:
    """GEMM FLOP/s at ``shapes`` and copy bandwidth on one device (this process's;
    default :func:`default_device`), with the device's facts: ``matmul_flops``,
    ``memory_bandwidth``, ``dtype``, ``device_name``, ``memory_bytes``, ``gpu_count``."""
    device = default_device() if device is None else torch.device(device)
    out: Dict[str, object] = dict(
        matmul_flops=calibrate_gemm(shapes, device, dtype, repeats),
        memory_bandwidth=calibrate_device_memory(device, memory_numel, dtype, repeats),
        dtype=dtype)
    out.update(_gpu_facts(device))
    return out


def device_share(nproc: int, gpu_count: int) -> float:
    """The share of one GPU each of ``nproc`` ranks gets: 1 when every rank has its own GPU,
    ``gpu_count / nproc`` when ranks share them round-robin (``choose_device``)."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    return 1.0 if gpu_count <= 0 else min(1.0, gpu_count / nproc)


def gpu_cluster_from(calibration: Dict[str, object], nproc: int) -> Cluster:
    """A :class:`Cluster` of ``nproc`` ranks on one node from :func:`device_calibration`
    plus an all-reduce fit (``latency_s``, ``busbw``; :func:`mpu_lab.perf.bandwidth.allreduce_fit`):
    peak = the measured GEMM rate at the run's shapes (so ``matmul_efficiency`` is 1), memory
    bandwidth = the measured copy, every link = the measured all-reduce, each rank's share of
    a GPU it shares with others (:func:`device_share`)."""
    share = device_share(nproc, int(calibration.get("gpu_count") or 0))
    memory = calibration.get("memory_bytes") or 1.0
    return Cluster(name=f"{calibration.get('device_name', 'GPU')} ({nproc} ranks, "
                        f"{calibration.get('dtype', 'bfloat16')})",
                   gpus_per_node=nproc, peak_flops=float(calibration["matmul_flops"]) * share,
                   intra_node_bandwidth=float(calibration["busbw"]),
                   inter_node_bandwidth=float(calibration["busbw"]),
                   hbm_bandwidth=float(calibration["memory_bandwidth"]) * share,
                   memory_bytes=float(memory) * share, matmul_efficiency=1.0,
                   bandwidth_efficiency=1.0, latency_s=float(calibration["latency_s"]))
