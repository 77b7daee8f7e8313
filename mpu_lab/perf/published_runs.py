"""The published runs the cost model is checked against, and the one constant fitted on them.

``published_runs.yaml`` holds the shapes, splits, batches and reported throughput of published
Megatron-LM runs: the ten rows of Narayanan et al. 2021 Table 1 (A100, TFLOP/s per GPU with
recomputation: the 96 form of the Appendix, eq. (3)) and the Megatron-LM README's GPT-3 175B runs on H100 (MFU, Korthikanti et
al. 2022 §6). One ``matmul_efficiency`` per GPU generation is fitted on one run
(:func:`fit_matmul_efficiency`) and held fixed to predict the others::

    runs = load_published_runs()
    table = published_runs_comparison()          # fit on one run per GPU, predict the others
    print(format_published_comparison(table))

:func:`effect_ablation` refits without each effect of the cost model in turn.
"""
from __future__ import annotations

import os
import pathlib
from typing import Dict, List, Optional, Sequence, Tuple

import yaml

from mpu_lab.perf.cost_model import (CLUSTERS, EFFECTS, Cluster, IterationPrediction,
                                     ModelShape, ParallelConfig, predict_iteration)

__all__ = ["PUBLISHED_RUNS_PATH", "DEFAULT_CALIBRATION_RUNS", "load_published_runs",
           "run_inputs", "reported_tflops", "predicted_tflops", "fit_matmul_efficiency",
           "published_runs_comparison", "effect_ablation", "format_published_comparison",
           "FLOP_CONVENTIONS", "worst_error"]

PUBLISHED_RUNS_PATH = pathlib.Path(__file__).with_name("published_runs.yaml")
DEFAULT_CALIBRATION_RUNS = {"a100": "GPT 1T", "h100": "GPT-3 175B (96 H100)"}
# Which FLOPs each kind of reported throughput counts (the forms of
# mpu_lab.perf.cost_model.counts.FLOP_FORMS): Narayanan et al. 2021 count the recomputed forward
# pass (hardware FLOPs, the 96 form), the MFU figures only the model's (the 72 form).
FLOP_CONVENTIONS = {"tflops_with_recompute": "96 form (HFU)", "mfu": "72 form (MFU)"}

def load_published_runs(path: Optional[os.PathLike] = None) -> dict:
    """The YAML file as a dict: ``sources``, ``clusters`` (gpu → preset key) and ``runs``."""
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
    """The prediction in the run's convention (:data:`FLOP_CONVENTIONS`): with recomputation
    FLOPs (Narayanan et al., the 96 form) or model FLOPs only (MFU, the 72 form)."""
    if metric == "mfu":
        return prediction.model_tflops_per_gpu
    return prediction.hardware_tflops_per_gpu


def fit_matmul_efficiency(run: dict, lo: float = 0.05, hi: float = 1.0, iters: int = 50,
                          ignore: Sequence[str] = ()) -> float:
    """The ``matmul_efficiency`` at which the model reproduces ``run``'s reported throughput
    (bisection; predicted throughput grows with the efficiency)."""
    model, cfg, cluster = run_inputs(run)
    target = reported_tflops(run, cluster)
    metric = run["reported"]["metric"]
    for _ in range(iters):
        mid = (lo + hi) / 2
        got = predicted_tflops(predict_iteration(model, cfg, cluster.replace(
            matmul_efficiency=mid), ignore=ignore), metric)
        lo, hi = (mid, hi) if got < target else (lo, mid)
    return round((lo + hi) / 2, 4)


def published_runs_comparison(calibrate_on: Optional[Dict[str, str]] = None,
                              data: Optional[dict] = None, ignore: Sequence[str] = ()
                              ) -> List[dict]:
    """Fit one matmul efficiency per GPU generation on one run each (``calibrate_on``: gpu →
    run name), hold it fixed, and predict every run. One dict per run: name, gpu, t, p, d, m,
    v, reported and predicted TFLOP/s per GPU (the run's convention), the relative error,
    the fitted efficiency, whether the row was the calibration run, and the predicted
    breakdown shares. ``ignore``: effects left out of the model (fit and predictions alike)."""
    data = data or load_published_runs()
    calibrate_on = calibrate_on or DEFAULT_CALIBRATION_RUNS
    by_name = {r["name"]: r for r in data["runs"]}
    for gpu, name in calibrate_on.items():
        if name not in by_name:
            raise ValueError(f"calibration run {name!r} for {gpu} is not in the data; "
                             f"runs: {sorted(by_name)}")
    eff = {gpu: fit_matmul_efficiency(by_name[name], ignore=ignore)
           for gpu, name in calibrate_on.items()}
    rows = []
    for run in data["runs"]:
        if run["gpu"] not in eff:
            continue
        model, cfg, cluster = run_inputs(run)
        pred = predict_iteration(model, cfg, cluster.replace(matmul_efficiency=eff[run["gpu"]]),
                                 ignore=ignore)
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


def effect_ablation(calibrate_on: Optional[Dict[str, str]] = None) -> List[dict]:
    """Which modelled effects the published-runs fit needs: refit without each one (and with
    all of them) and report the worst error over the predicted runs, per GPU generation."""
    out = []
    for ignore in [()] + [(e,) for e in EFFECTS]:
        rows = published_runs_comparison(calibrate_on, ignore=ignore)
        entry = dict(left_out=ignore[0] if ignore else "nothing")
        for gpu in sorted({r["gpu"] for r in rows}):
            errs = [r["error"] for r in rows if r["gpu"] == gpu and not r["calibration"]]
            entry[f"worst_{gpu}"] = round(max(errs, key=abs), 3)
        out.append(entry)
    return out


def worst_error(rows: Sequence[dict]) -> float:
    """The largest relative error, in absolute value, over the predicted (not fitted) rows of
    :func:`published_runs_comparison`: how far the cost model has been seen to miss."""
    errors = [abs(r["error"]) for r in rows if not r["calibration"]]
    if not errors:
        raise ValueError("no predicted rows: every row is a calibration run")
    return max(errors)


def format_published_comparison(rows: Sequence[dict]) -> str:
    """A fixed-width text table of :func:`published_runs_comparison` (deterministic). The
    TFLOP/s of a row count the FLOPs its source counts (:data:`FLOP_CONVENTIONS`); the last
    column gives the efficiency fitted on the calibration runs."""
    wide = max([len("run")] + [len(r["name"]) for r in rows])
    head = (f"{'run':<{wide}}{'GPUs':>6}{'t':>3}{'p':>4}{'d':>5}{'m':>5}{'v':>3}"
            f"{'reported':>9}{'predicted':>10}{'error':>7}  {'TFLOP/s count':<15}fitted")
    lines = [head, "-" * (len(head) + 3)]
    for r in rows:
        note = f"eff {r['efficiency']:.3f}" if r["calibration"] else ""
        lines.append(f"{r['name']:<{wide}}{r['gpus']:>6}{r['t']:>3}{r['p']:>4}{r['d']:>5}"
                     f"{r['m']:>5}{r['v']:>3}{r['reported_tflops']:>9.1f}"
                     f"{r['predicted_tflops']:>10.1f}{100 * r['error']:>6.1f}%  "
                     f"{FLOP_CONVENTIONS[r['metric']]:<15}{note}".rstrip())
    return "\n".join(lines)

