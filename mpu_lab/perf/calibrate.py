"""Calibrate the cost model: on published runs (one efficiency per GPU generation) and on this
machine (a matmul and an all-reduce measurement), and compare predictions with measurements.

Published runs (``published_runs.yaml``)::

    runs = load_published_runs()
    table = published_runs_comparison()          # fit on one run per GPU, predict the others
    print(format_published_comparison(table))

This machine::

    cluster = cpu_cluster(nproc=2)               # measures matmul FLOP/s and all-reduce bandwidth
    predict_iteration(model, cfg, cluster)

``launch/bench_cost_model.py`` runs small ``train_gpt.py`` configurations and prints measured vs
predicted step times with :func:`measure_vs_predict`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from mpu_lab.perf.model import (CLUSTERS, Cluster, ModelShape, ParallelConfig,
                                IterationPrediction, predict_iteration)

PUBLISHED_RUNS_PATH = pathlib.Path(__file__).with_name("published_runs.yaml")
DEFAULT_CALIBRATION_RUNS = {"a100": "GPT 1T", "h100": "GPT-3 175B (96 H100)"}


# --------------------------------------------------------------------------- published runs
def load_published_runs(path: Optional[os.PathLike] = None) -> dict:
    """The YAML file as a dict: ``sources``, ``clusters`` (gpu → preset key) and ``runs``."""
    import yaml
    with open(path or PUBLISHED_RUNS_PATH) as f:
        return yaml.safe_load(f)


def run_inputs(run: dict, clusters: Optional[Dict[str, str]] = None
               ) -> Tuple[ModelShape, ParallelConfig, Cluster]:
    """(ModelShape, ParallelConfig, Cluster preset) for one entry of ``runs``."""
    m, par = run["model"], run["parallel"]
    model = ModelShape(num_layers=m["num_layers"], hidden_size=m["hidden_size"],
                       num_attention_heads=m["num_attention_heads"],
                       seq_length=m["seq_length"], vocab_size=m["vocab_size"], name=run["name"])
    tp, pp, n = par["tp"], par["pp"], par["num_gpus"]
    if n % (tp * pp):
        raise ValueError(f"{run['name']}: {n} GPUs are not divisible by tp {tp} x pp {pp}")
    cfg = ParallelConfig(
        tp=tp, pp=pp, dp=n // (tp * pp), micro_batch_size=par["micro_batch_size"],
        global_batch_size=par["global_batch_size"], virtual_stages=par.get("virtual_stages", 1),
        sequence_parallel=par.get("sequence_parallel", False),
        recompute=par.get("recompute", "none"),
        flash_attention=par.get("flash_attention", False),
        distributed_optimizer=par.get("distributed_optimizer", False),
        overlap_grad_reduce=par.get("overlap_grad_reduce", False),
        overlap_tp_comm=par.get("overlap_tp_comm", False),
        overlap_p2p_comm=par.get("overlap_p2p_comm", False))
    preset = (clusters or {"a100": "dgx-a100-80gb", "h100": "dgx-h100"})[run["gpu"]]
    return model, cfg, CLUSTERS[preset]


def reported_tflops(run: dict, cluster: Cluster) -> float:
    """The run's reported throughput in TFLOP/s per GPU, in its own FLOP convention."""
    rep = run["reported"]
    if rep["metric"] == "mfu":
        return rep["mfu"] * cluster.peak_flops / 1e12
    return float(rep["tflops_per_gpu"])


def predicted_tflops(prediction: IterationPrediction, metric: str) -> float:
    """The prediction in the run's convention: with recomputation FLOPs (Narayanan et al.) or
    model FLOPs only (MFU)."""
    if metric == "mfu":
        return prediction.model_tflops_per_gpu
    return prediction.hardware_tflops_per_gpu


def fit_matmul_efficiency(run: dict, lo: float = 0.05, hi: float = 1.0, iters: int = 50
                          ) -> float:
    """The ``matmul_efficiency`` at which the model reproduces ``run``'s reported throughput
    (bisection; predicted throughput grows with the efficiency)."""
    model, cfg, cluster = run_inputs(run)
    target = reported_tflops(run, cluster)
    metric = run["reported"]["metric"]
    for _ in range(iters):
        mid = (lo + hi) / 2
        got = predicted_tflops(predict_iteration(model, cfg, cluster.replace(
            matmul_efficiency=mid)), metric)
        lo, hi = (mid, hi) if got < target else (lo, mid)
    return round((lo + hi) / 2, 4)


def published_runs_comparison(calibrate_on: Optional[Dict[str, str]] = None,
                              data: Optional[dict] = None) -> List[dict]:
    """Fit one matmul efficiency per GPU generation on one run each (``calibrate_on``: gpu →
    run name), hold it fixed, and predict every run. One dict per run: name, gpu, t, p, d, m,
    v, reported and predicted TFLOP/s per GPU (the run's convention), the relative error,
    the fitted efficiency, whether the row was the calibration run, and the predicted
    breakdown shares."""
    data = data or load_published_runs()
    calibrate_on = calibrate_on or DEFAULT_CALIBRATION_RUNS
    by_name = {r["name"]: r for r in data["runs"]}
    for gpu, name in calibrate_on.items():
        if name not in by_name:
            raise ValueError(f"calibration run {name!r} for {gpu} is not in the data; "
                             f"runs: {sorted(by_name)}")
    eff = {gpu: fit_matmul_efficiency(by_name[name]) for gpu, name in calibrate_on.items()}
    rows = []
    for run in data["runs"]:
        if run["gpu"] not in eff:
            continue
        model, cfg, cluster = run_inputs(run)
        pred = predict_iteration(model, cfg, cluster.replace(matmul_efficiency=eff[run["gpu"]]))
        reported = reported_tflops(run, cluster)
        predicted = predicted_tflops(pred, run["reported"]["metric"])
        rows.append(dict(
            name=run["name"], gpu=run["gpu"], t=cfg.tp, p=cfg.pp, d=cfg.dp, m=cfg.m, v=cfg.v,
            gpus=cfg.num_gpus, metric=run["reported"]["metric"],
            reported_tflops=round(reported, 1), predicted_tflops=round(predicted, 1),
            error=round(predicted / reported - 1, 4), efficiency=eff[run["gpu"]],
            calibration=run["name"] == calibrate_on[run["gpu"]],
            shares={k: round(v, 3) for k, v in pred.shares().items()},
            memory_gb=round(pred.memory_gb, 1), fits=pred.fits))
    return rows


def format_published_comparison(rows: Sequence[dict]) -> str:
    """A fixed-width text table of :func:`published_runs_comparison` (deterministic)."""
    head = (f"{'run':<24}{'GPUs':>6}{'t':>3}{'p':>4}{'d':>5}{'m':>5}{'v':>3}"
            f"{'reported':>10}{'predicted':>11}{'error':>8}  note")
    lines = [head, "-" * len(head)]
    for r in rows:
        note = f"fitted here (eff {r['efficiency']:.3f})" if r["calibration"] else ""
        lines.append(f"{r['name']:<24}{r['gpus']:>6}{r['t']:>3}{r['p']:>4}{r['d']:>5}{r['m']:>5}"
                     f"{r['v']:>3}{r['reported_tflops']:>10.1f}{r['predicted_tflops']:>11.1f}"
                     f"{100 * r['error']:>7.1f}%  {note}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- this machine
def calibrate_matmul(size: Tuple[int, int, int] = (512, 256, 1024), threads: Optional[int] = None,
                     repeats: int = 20, dtype: str = "float32") -> float:
    """Measured FLOP/s of one ``(m, k) @ (k, n)`` matmul with ``threads`` torch threads (default:
    the thread count each of ``nproc`` ranks gets, as mpu_lab.launch sets OMP_NUM_THREADS).
    The median of ``repeats`` timings, after two warm-up calls."""
    import torch
    m, k, n = size
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        dt = getattr(torch, dtype)
        a, b = torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)
        for _ in range(2):
            a @ b
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        times.sort()
        return 2.0 * m * k * n / times[len(times) // 2]
    finally:
        torch.set_num_threads(old)


def calibrate_memory_bandwidth(numel: int = 1 << 22, threads: Optional[int] = None,
                               repeats: int = 20) -> float:
    """Measured bytes/s of an elementwise add over ``numel`` fp32 values (reads 2, writes 1)."""
    import torch
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        x, y, out = torch.randn(numel), torch.randn(numel), torch.empty(numel)
        torch.add(x, y, out=out)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.add(x, y, out=out)
            times.append(time.perf_counter() - t0)
        times.sort()
        return 3 * 4 * numel / times[len(times) // 2]
    finally:
        torch.set_num_threads(old)


def calibrate_allreduce(nproc: int = 2, nbytes: int = 1 << 22, timeout_s: float = 120
                        ) -> Dict[str, float]:
    """Bus bandwidth (bytes/s) and latency (s) of a gloo all-reduce among ``nproc`` local ranks.

    Runs ``launch/bench_cost_model.py --worker allreduce`` under torchrun (mpu_lab.launch.run)
    and fits ``time = latency + 2(n-1)/n · bytes / busbw`` to a small and a large message."""
    from mpu_lab import launch
    job = launch.run("bench_cost_model.py", ["--worker", "allreduce", "--nbytes", str(nbytes)],
                     nproc=nproc, show="none", timeout_s=timeout_s)
    return job.results[0]


def cpu_cluster(nproc: int = 2, matmul_size: Tuple[int, int, int] = (512, 256, 1024),
                allreduce: Optional[Dict[str, float]] = None,
                matmul_flops: Optional[float] = None) -> Cluster:
    """A :class:`Cluster` for this machine, from measurements: one "node" of ``nproc`` ranks
    sharing the CPU cores, peak = measured matmul FLOP/s at each rank's thread count (so
    ``matmul_efficiency`` is 1), memory bandwidth measured the same way, all-reduce bus
    bandwidth and latency from a real gloo job (:func:`calibrate_allreduce`)."""
    import psutil
    threads = max(1, (os.cpu_count() or 1) // nproc)
    flops = matmul_flops or calibrate_matmul(matmul_size, threads=threads)
    mem_bw = calibrate_memory_bandwidth(threads=threads)
    ar = allreduce or calibrate_allreduce(nproc)
    return Cluster(name=f"this CPU ({os.cpu_count()} cores, {nproc} ranks)", gpus_per_node=nproc,
                   peak_flops=flops, intra_node_bandwidth=ar["busbw"],
                   inter_node_bandwidth=ar["busbw"], hbm_bandwidth=mem_bw,
                   memory_bytes=float(psutil.virtual_memory().total) / nproc,
                   matmul_efficiency=1.0, bandwidth_efficiency=1.0, latency_s=ar["latency_s"])


@dataclasses.dataclass
class TrainConfig:
    """One small ``launch/train_gpt.py`` run to measure: model shape and parallel sizes."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    num_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 4
    seq_length: int = 128
    vocab_size: int = 512
    micro_batch_size: int = 8
    global_batch_size: int = 8
    train_iters: int = 12
    sequence_parallel: bool = False

    @property
    def nproc(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        return f"t={self.tp} p={self.pp} d={self.dp} h={self.hidden_size} L={self.num_layers}"

    def shapes(self) -> Tuple[ModelShape, ParallelConfig]:
        # train_gpt.py pads the vocabulary to a multiple of 128·t (Megatron's rule)
        mult = 128 * self.tp
        vocab = -(-self.vocab_size // mult) * mult
        model = ModelShape(self.num_layers, self.hidden_size, self.num_attention_heads,
                           self.seq_length, vocab)
        cfg = ParallelConfig(tp=self.tp, pp=self.pp, dp=self.dp,
                             micro_batch_size=self.micro_batch_size,
                             global_batch_size=self.global_batch_size,
                             sequence_parallel=self.sequence_parallel)
        return model, cfg

    def argv(self, metrics_file: str) -> List[str]:
        args = ["--tensor-model-parallel-size", self.tp, "--pipeline-model-parallel-size",
                self.pp, "--num-layers", self.num_layers, "--hidden-size", self.hidden_size,
                "--num-attention-heads", self.num_attention_heads, "--seq-length",
                self.seq_length, "--vocab-size", self.vocab_size, "--micro-batch-size",
                self.micro_batch_size, "--global-batch-size", self.global_batch_size,
                "--train-iters", self.train_iters, "--log-interval", 1, "--quiet",
                "--metrics-file", metrics_file]
        if self.sequence_parallel:
            args.append("--sequence-parallel")
        return [str(a) for a in args]


def measure_step_time(tc: TrainConfig, skip: int = 4, timeout_s: float = 180) -> float:
    """Median ``iteration_time_s`` of a real ``train_gpt.py`` run (the first ``skip`` logged
    iterations are warm-up and left out)."""
    from mpu_lab import launch
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "metrics.jsonl")
        launch.run("train_gpt.py", tc.argv(path), nproc=tc.nproc, show="none",
                   timeout_s=timeout_s)
        with open(path) as f:
            times = [json.loads(line)["iteration_time_s"] for line in f if line.strip()]
    times = sorted(times[skip:] or times)
    return times[len(times) // 2]


def measure_vs_predict(configs: Sequence[TrainConfig], cluster: Optional[Cluster] = None,
                       nproc_for_calibration: int = 2) -> List[dict]:
    """For each config: measured step time (real torchrun job) and the model's prediction on
    ``cluster`` (default: :func:`cpu_cluster` measured now). Returns rows with both and their
    ratio; fp32 on CPU, so 4-byte activations and gradients."""
    cluster = cluster or cpu_cluster(nproc_for_calibration)
    rows = []
    for tc in configs:
        model, cfg = tc.shapes()
        pred = predict_iteration(model, cfg, cluster, dtype_bytes=4, grad_bytes=4)
        measured = measure_step_time(tc)
        rows.append(dict(config=tc.label(), nproc=tc.nproc, measured_s=round(measured, 4),
                         predicted_s=round(pred.total_s, 4),
                         ratio=round(measured / pred.total_s, 2),
                         breakdown={k: round(v, 4) for k, v in pred.breakdown().items()}))
    return rows


def format_measure_vs_predict(rows: Sequence[dict]) -> str:
    """Fixed-width text table of :func:`measure_vs_predict` rows."""
    head = f"{'config':<34}{'ranks':>6}{'measured s':>12}{'predicted s':>13}{'ratio':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['config']:<34}{r['nproc']:>6}{r['measured_s']:>12.4f}"
                     f"{r['predicted_s']:>13.4f}{r['ratio']:>7.2f}")
    return "\n".join(lines)
