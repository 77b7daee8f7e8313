"""Calibrate the cost model on this machine, and check its predictions against real training runs.

This machine: one short ``torchrun`` job (:func:`calibrate_ranks`) times each rank's matmuls
(:func:`layer_matmul_shapes`, the GEMMs of one layer, Narayanan et al. 2021 §3), the
memory-bound element-wise ops and a gloo all-reduce (ring model, Patarasuk & Yuan 2009), and
:func:`cpu_cluster` turns that into a :class:`~mpu_lab.perf.cost_model.Cluster`::

    cluster = cpu_cluster(nproc=2)        # a 2-rank torchrun job times matmuls and an all-reduce
    predict_iteration(model, cfg, cluster, dtype_bytes=4, grad_bytes=4)

:class:`TrainConfig` is one small ``launch/train_gpt.py`` run; :func:`measure_vs_predict`
measures such runs and predicts them (``launch/bench_cost_model.py`` prints the table).
The published runs and the efficiency fitted on them are in :mod:`mpu_lab.perf.published_runs`.

On a GPU (picked automatically: :func:`device_cluster`, :func:`measure_vs_predict`) the
matmuls are the run's layer GEMMs in bf16 timed with CUDA events in this process and the
all-reduce is NCCL's (:mod:`mpu_lab.perf.calibrate_gpu`, :func:`gpu_cluster`)::

    cluster = gpu_cluster(nproc=2, shapes=layer_matmul_shapes(model, cfg))
    predict_iteration(model, cfg, cluster, dtype_bytes=2, grad_bytes=4)
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from mpu_lab import launcher
from mpu_lab.perf.bandwidth import allreduce_fit
from mpu_lab.perf.calibrate_gpu import (calibrate_gemm, cuda_available, device_calibration,
                                        gpu_cluster_from)
from mpu_lab.perf.cost_model import Cluster, ModelShape, ParallelConfig, predict_iteration
from mpu_lab.perf.op_classes import compare_terms, op_class_profiles
from mpu_lab.perf.step_time import TrainConfig, cpu_pressure_us, measure_step_time  # noqa: F401 (re-exported)

# --------------------------------------------------------------------------- this machine
def _best_time(fn, repeats: int) -> float:
    """Fastest of ``repeats`` calls after two warm-up calls. The minimum, not the median: on a
    shared machine the slower calls measure the other processes (timeit's reasoning)."""
    fn()
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _with_threads(threads: Optional[int], fn):
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


def layer_matmul_shapes(model: ModelShape, cfg: ParallelConfig) -> List[Tuple[int, int, int, int]]:
    """The forward GEMMs of one layer on one tensor-parallel rank, as (batch, m, k, n):
    QKV (b·s × h → 3h/t), attention scores and weighted sum per head (b·a/t batches of
    s × h/a × s and s × s × h/a), output projection (h/t → h), MLP (h → ffn/t → h)."""
    t, bs, h = cfg.tp, cfg.b * model.s, model.h
    heads, hd = model.a // t, model.h // model.a
    return [(1, bs, h, 3 * h // t), (cfg.b * heads, model.s, hd, model.s),
            (cfg.b * heads, model.s, model.s, hd), (1, bs, h // t, h),
            (1, bs, h, model.ffn // t), (1, bs, model.ffn // t, h)]


def calibrate_matmul(shapes: Sequence[Tuple[int, int, int, int]] = ((1, 1024, 256, 1024),),
                     threads: Optional[int] = None, repeats: int = 10,
                     dtype: str = "float32") -> float:
    """Measured FLOP/s of a set of (batched) matmuls ``(batch, m, k, n)`` — e.g.
    :func:`layer_matmul_shapes` of the model being predicted — with ``threads`` torch threads
    (pass the count each rank gets: mpu_lab.launcher sets OMP_NUM_THREADS = cores / ranks).
    Total FLOPs over the sum of the best times of each shape."""
    dt = getattr(torch, dtype)

    def measure():
        flops = seconds = 0.0
        for batch, m, k, n in shapes:
            a, b = torch.randn(batch, m, k, dtype=dt), torch.randn(batch, k, n, dtype=dt)
            seconds += _best_time(lambda: torch.bmm(a, b), repeats)
            flops += 2.0 * batch * m * k * n
        return flops / seconds
    return _with_threads(threads, measure)


def calibrate_memory_bandwidth(numel: int = 1 << 21, threads: Optional[int] = None,
                               repeats: int = 10, hidden: int = 512, scores: int = 128
                               ) -> float:
    """Bytes/s that a layer's non-matmul ops achieve here: the best times of a residual add,
    a GeLU, a softmax over rows of ``scores`` and a layer norm over rows of ``hidden``, each
    on ``numel`` fp32 values, total bytes read and written over total time. On a GPU these ops
    are bound by memory bandwidth; on a CPU the transcendental ones (GeLU, softmax) run 3-5x
    slower than an add, so timing only an add would overstate the figure the model's
    memory-bound term (:data:`mpu_lab.perf.cost_model.ELEMENTWISE_PASSES`) divides by."""
    def measure():
        x, y = torch.randn(numel // hidden, hidden), torch.randn(numel // hidden, hidden)
        z = torch.randn(numel // scores, scores)
        ops = [(lambda: x + y, 3), (lambda: F.gelu(x), 2), (lambda: torch.softmax(z, -1), 2),
               (lambda: F.layer_norm(x, (hidden,)), 2)]
        seconds = sum(_best_time(fn, repeats) for fn, _ in ops)
        return sum(n for _, n in ops) * 4 * numel / seconds
    return _with_threads(threads, measure)


def calibrate_allreduce(nproc: int = 2, min_bytes: str = "4K", max_bytes: str = "4M",
                        timeout_s: float = 120) -> Dict[str, float]:
    """Latency (s) and bus bandwidth (bytes/s) of an all-reduce among ``nproc`` local ranks,
    measured by the real collective benchmark (``launch/bench_bandwidth.py`` under torchrun).

    The smallest message's time is taken as the latency; the bandwidth comes from the largest:
    ``busbw = 2(n-1)/n · S / (t - latency)`` — the ring model :func:`predict_iteration` uses."""
    job = launcher.run("bench_bandwidth.py", ["--ops", "all_reduce", "--min-bytes", min_bytes,
                                            "--max-bytes", max_bytes, "--factor", "4"],
                     nproc=nproc, show="none", timeout_s=timeout_s)
    return allreduce_fit(job.results[0]["rows"])


def calibrate_ranks(nproc: int = 2,
                    shape_sets: Optional[Sequence[Sequence[Tuple[int, int, int, int]]]] = None,
                    timeout_s: float = 120) -> Dict[str, float]:
    """Calibrate this machine the way a job of ``nproc`` ranks sees it: one short torchrun job
    (``launch/bench_cost_model.py --worker``) in which every rank at once times each set of
    matmuls in ``shape_sets`` (default: one 1024×256×1024 GEMM) and an elementwise add with the
    threads it really gets, then a gloo all-reduce of 4 KiB issued right after a matmul (the
    latency a layer sees) and of 4 MiB (the bandwidth). Returns the ranks' mean
    ``matmul_flops`` (first set), ``matmul_flops_sets`` (one per set) and
    ``memory_bandwidth``, and ``latency_s`` and ``busbw`` (ring model:
    ``2(n-1)/n · S / (t - latency)``)."""
    args = ["--worker"]
    if shape_sets:
        args += ["--shape-sets", json.dumps([[list(x) for x in shapes] for shapes in shape_sets])]
    job = launcher.run("bench_cost_model.py", args, nproc=nproc, show="none", timeout_s=timeout_s)
    res = job.results
    sets = [sum(r["matmul_flops_sets"][i] for r in res) / nproc
            for i in range(len(res[0]["matmul_flops_sets"]))]
    return dict(nproc=nproc, matmul_flops=sets[0], matmul_flops_sets=sets,
                memory_bandwidth=sum(r["memory_bandwidth"] for r in res) / nproc,
                latency_s=res[0].get("latency_s", 0.0), busbw=res[0].get("busbw", 1e12))


def cpu_cluster(nproc: int = 2, calibration: Optional[Dict[str, float]] = None) -> Cluster:
    """A :class:`Cluster` for this machine with ``nproc`` ranks on one "node", from
    :func:`calibrate_ranks` (run now unless ``calibration`` is given): peak = the measured
    matmul FLOP/s per rank (so ``matmul_efficiency`` is 1), memory bandwidth, and the gloo
    all-reduce's latency and bus bandwidth for every link."""
    import psutil
    cal = calibration or calibrate_ranks(nproc)
    return Cluster(name=f"this CPU ({os.cpu_count()} cores, {nproc} ranks)", gpus_per_node=nproc,
                   peak_flops=cal["matmul_flops"], intra_node_bandwidth=cal["busbw"],
                   inter_node_bandwidth=cal["busbw"], hbm_bandwidth=cal["memory_bandwidth"],
                   memory_bytes=float(psutil.virtual_memory().total) / nproc,
                   matmul_efficiency=1.0, bandwidth_efficiency=1.0,
                   latency_s=cal["latency_s"])


def gpu_cluster(nproc: int = 2, calibration: Optional[Dict[str, object]] = None,
                shapes: Optional[Sequence[Tuple[int, int, int, int]]] = None,
                dtype: str = "bfloat16") -> Cluster:
    """The GPU counterpart of :func:`cpu_cluster`: ``nproc`` ranks on this node, from
    :func:`mpu_lab.perf.calibrate_gpu.device_calibration` (the GEMMs ``shapes`` — default one
    4096×4096×4096 — in ``dtype`` with CUDA events, and a device copy) and
    :func:`calibrate_allreduce` (an NCCL all-reduce among ``nproc`` ranks; its rows
    bandwidth and latency), both run now unless ``calibration`` holds them."""
    cal = calibration or dict(
        device_calibration(shapes or [(1, 4096, 4096, 4096)], dtype=dtype),
        **calibrate_allreduce(nproc, max_bytes="16M"))
    return gpu_cluster_from(cal, nproc)


def calibrate_gpu_ranks(nproc: int = 2,
                        shape_sets: Optional[Sequence[Sequence[Tuple[int, int, int, int]]]] = None,
                        dtypes: Optional[Sequence[str]] = None) -> Dict[str, object]:
    """The GPU counterpart of :func:`calibrate_ranks`, with the same keys (and the device's):
    each set of GEMMs timed in its dtype (default bf16) on this process's GPU, the copy
    bandwidth, and :func:`calibrate_allreduce` among ``nproc`` ranks (NCCL with a GPU per rank,
    gloo on CUDA tensors where ranks share one: :func:`mpu_lab.training.initialize.choose_backend`)."""
    shape_sets = list(shape_sets or [[(1, 4096, 4096, 4096)]])
    dtypes = list(dtypes or ["bfloat16"] * len(shape_sets))
    cal = device_calibration(shape_sets[0], dtype=dtypes[0])
    sets = [cal["matmul_flops"]] + [calibrate_gemm(x, dtype=d)
                                    for x, d in zip(shape_sets[1:], dtypes[1:])]
    return {**cal, **calibrate_allreduce(nproc, max_bytes="16M"), "matmul_flops_sets": sets}


def device_cluster(nproc: int = 2, shapes=None) -> Cluster:
    """:func:`gpu_cluster` where this process sees a CUDA GPU, else :func:`cpu_cluster`."""
    return gpu_cluster(nproc, shapes=shapes) if cuda_available() else cpu_cluster(nproc)


def host_overhead(tc: TrainConfig, cluster: Cluster, dtype_bytes: int = 4,
                  attempts: int = 1, tries: int = 1) -> Dict[str, float]:
    """The seconds per iteration the host spends on work that does not scale with the model's
    width — Python, the autograd engine, op dispatch, small collectives the model has no term
    for (the gradient norm's, the loss log's, the TP group's data broadcast) — measured on
    this machine: the fastest step of ``tc.tiny()`` (the same run at a width where arithmetic
    vanishes) minus what the cost model predicts for that tiny run on ``cluster`` (its
    latencies; the rest is ~0). Returns ``tiny_measured_s``, ``tiny_predicted_s`` and
    ``host_overhead_s`` (their difference, at least 0), the cost model's ``host_overhead_s``.
    On a CPU it adds to the step; on a GPU the host runs ahead of the device and it is hidden
    unless the GPU waits for it, so :func:`measure_vs_predict` measures it on a CPU only."""
    tiny = tc.tiny()
    measured = _fastest(tiny, attempts, tries)["best"]
    model, cfg = tiny.shapes()
    predicted = predict_iteration(model, cfg, cluster, dtype_bytes=dtype_bytes,
                                  grad_bytes=4).total_s
    return dict(tiny_measured_s=measured, tiny_predicted_s=predicted,
                host_overhead_s=max(0.0, measured - predicted))


def _least_contended(tc: TrainConfig, attempts: int) -> Dict[str, float]:
    best = None
    for _ in range(attempts):
        got = measure_step_time(tc)
        if best is None or (got["cpu_pressure"] or 0) < (best["cpu_pressure"] or 0):
            best = got
        if (best["cpu_pressure"] or 0) <= 0.10:
            break
    return best


def _fastest(tc: TrainConfig, attempts: int, tries: int) -> Dict[str, float]:
    """The fastest of ``tries`` runs of ``tc`` (each :func:`_least_contended`): a run that a
    passing disturbance slowed as a whole does not count."""
    return min((_least_contended(tc, attempts) for _ in range(tries)), key=lambda r: r["best"])


def _mean_calibration(a: Dict[str, float], b: Dict[str, float]) -> Dict[str, float]:
    keys = ("matmul_flops", "memory_bandwidth", "latency_s", "busbw")
    out = {k: v for k, v in a.items() if k not in keys}   # on a GPU: its name, memory, count
    out.update({k: (a[k] + b[k]) / 2 for k in keys})
    out["matmul_flops_sets"] = [(x + y) / 2 for x, y in zip(a["matmul_flops_sets"],
                                                          b["matmul_flops_sets"])]
    out["drift"] = abs(a["matmul_flops"] - b["matmul_flops"]) / out["matmul_flops"]
    return out


def profile_terms(tc: TrainConfig, prediction, measured_step_s: float,
                  timeout_s: float = 300) -> List[dict]:
    """Run ``tc`` once more under ``torch.profiler`` (``--breakdown-profile``) and set its op
    classes against ``prediction``'s terms (:func:`mpu_lab.perf.op_classes.compare_terms`;
    ``scaled_s``: each class's share of the profiled step times ``measured_step_s``, the
    unprofiled run's)."""
    with tempfile.TemporaryDirectory() as tmp:
        job = launcher.run("train_gpt.py", tc.argv() + ["--breakdown-profile", tmp],
                           nproc=tc.nproc, show="none", timeout_s=timeout_s)
        profiles = op_class_profiles(job.results)
    return compare_terms(profiles, prediction, measured_step_s)


def measure_vs_predict(configs: Sequence[TrainConfig], attempts: int = 1,
                       terms: bool = False, tries: int = 1) -> List[dict]:
    """For each config: predict its step time on this machine and measure it (a real
    ``train_gpt.py`` job). The machine is calibrated (:func:`calibrate_ranks`, timing each
    config's own layer GEMMs on as many ranks) right before and right after the training jobs
    of each rank count, and the two are averaged: on a shared machine the speed drifts, and
    ``calibration_drift`` (how far the two matmul rates differ) says how much. fp32 on CPU:
    4-byte activations and gradients. Where this process sees a GPU the calibration is
    :func:`calibrate_gpu_ranks` (GEMMs in bf16 for a ``bf16`` config, else fp32) and the
    cluster :func:`gpu_cluster`; a ``bf16`` config predicts 2-byte activations.
    ``measured_s`` is the fastest iteration (as the
    calibration takes the fastest call), ``measured_median_s`` the median, ``cpu_pressure`` the
    share of the run other processes kept a task waiting for a CPU; with ``attempts`` > 1 a
    contended run (pressure over 10 %) is repeated and the least contended attempt kept; with
    ``tries`` > 1 every run is made that many times and the fastest kept.
    On a CPU each config's host overhead is measured too (:func:`host_overhead`: the same run
    at a tiny width) and enters the prediction as its ``framework`` term. With ``terms`` each
    row also holds ``terms``: the run profiled and set against the prediction term by term
    (:func:`profile_terms`)."""
    if attempts < 1 or tries < 1:
        raise ValueError(f"attempts and tries must be >= 1, got {attempts} and {tries}")
    shapes = [tc.shapes() for tc in configs]
    on_gpu = cuda_available()
    rows: Dict[int, dict] = {}
    for n in sorted({tc.nproc for tc in configs}):
        idx = [i for i, tc in enumerate(configs) if tc.nproc == n]
        sets = [layer_matmul_shapes(*shapes[i]) for i in idx]
        dtypes = ["bfloat16" if configs[i].bf16 else "float32" for i in idx]
        calibrate = ((lambda: calibrate_gpu_ranks(n, sets, dtypes)) if on_gpu
                     else (lambda: calibrate_ranks(n, sets)))
        before = calibrate()
        measured = {i: _fastest(configs[i], attempts, tries) for i in idx}
        cal = _mean_calibration(before, calibrate())
        for j, i in enumerate(idx):
            model, cfg = shapes[i]
            cluster = (gpu_cluster if on_gpu else cpu_cluster)(
                n, dict(cal, matmul_flops=cal["matmul_flops_sets"][j]))
            dtype_bytes = 2 if configs[i].bf16 else 4
            host = (dict(host_overhead_s=0.0) if on_gpu else
                    host_overhead(configs[i], cluster, dtype_bytes, attempts, tries))
            pred = predict_iteration(model, cfg, cluster, dtype_bytes=dtype_bytes, grad_bytes=4,
                                     host_overhead_s=host["host_overhead_s"])
            rows[i] = dict(
                config=configs[i].label(), nproc=n, measured_s=round(measured[i]["best"], 4),
                measured_median_s=round(measured[i]["median"], 4),
                predicted_s=round(pred.total_s, 4),
                ratio=round(measured[i]["best"] / pred.total_s, 2),
                breakdown={k: round(v, 4) for k, v in pred.breakdown().items()},
                matmul_gflops=round(cluster.peak_flops / 1e9, 1),
                memory_gbs=round(cluster.hbm_bandwidth / 1e9, 1),
                allreduce_latency_ms=round(cluster.latency_s * 1e3, 3),
                allreduce_busbw_gbs=round(cluster.intra_node_bandwidth / 1e9, 3),
                calibration_drift=round(cal["drift"], 2),
                host_overhead_s=round(host["host_overhead_s"], 4),
                terms=profile_terms(configs[i], pred, measured[i]["best"]) if terms else None,
                cpu_pressure=None if measured[i]["cpu_pressure"] is None
                else round(measured[i]["cpu_pressure"], 2))
    return [rows[i] for i in range(len(configs))]


def format_measure_vs_predict(rows: Sequence[dict]) -> str:
    """Fixed-width text table of :func:`measure_vs_predict` rows."""
    head = (f"{'config':<26}{'ranks':>6}{'measured s':>12}{'(median)':>10}{'predicted s':>13}"
            f"{'ratio':>7}{'CPU contended':>15}")
    lines = [head, "-" * len(head)]
    for r in rows:
        pressure = "?" if r.get("cpu_pressure") is None else f"{r['cpu_pressure']:.0%}"
        lines.append(f"{r['config']:<26}{r['nproc']:>6}{r['measured_s']:>12.4f}"
                     f"{r['measured_median_s']:>10.4f}{r['predicted_s']:>13.4f}{r['ratio']:>7.2f}"
                     f"{pressure:>15}")
    return "\n".join(lines)
