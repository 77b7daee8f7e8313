"""One profiled training run, and the cost model's prediction for it.

:func:`profile_training` runs ``launch/train_gpt.py --breakdown`` under a
:class:`~mpu_lab.perf.utilisation.UtilisationSampler` and returns a :class:`ProfiledRun`: every
rank's step-time breakdown (:mod:`mpu_lab.perf.breakdown`), the utilisation samples of the
timed steps and rank 0's metrics. :func:`measured_vs_predicted` puts such a run next to
:func:`mpu_lab.perf.cost_model.predict_iteration`'s breakdown, cause by cause (the measured
p2p time holds the pipeline bubble, Narayanan et al. 2021 §2.2); :func:`compare_with_model`
does it for several CPU runs with the cost model calibrated on this machine
(:mod:`mpu_lab.perf.calibrate`, :func:`mpu_lab.perf.bandwidth.allreduce_fit`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Sequence

from mpu_lab import training
from mpu_lab.perf import calibrate
from mpu_lab.perf.bandwidth import allreduce_fit
from mpu_lab.perf.calibrate_gpu import device_calibration, gpu_cluster_from
from mpu_lab.perf.breakdown import breakdowns, training_window
from mpu_lab.perf.cost_model import predict_iteration
from mpu_lab.perf.utilisation import Utilisation, run_with_utilisation
from mpu_lab.perf.breakdown import COMPUTE

__all__ = ["ProfiledRun", "PRECISIONS", "precision_flags", "training_flags", "format_utilisation",
           "profile_training",
           "measured_vs_predicted", "format_measured_vs_predicted", "compare_with_model"]


@dataclasses.dataclass
class ProfiledRun:
    """A ``train_gpt.py --breakdown`` job with its utilisation samples: ``reports`` (each
    rank's breakdown), ``utilisation`` (cropped to the timed steps), ``metrics`` (rank 0's
    logged iterations) and the job's wall-clock ``elapsed_s``."""
    label: str
    nproc: int
    reports: List[dict]
    utilisation: Utilisation
    metrics: List[dict]
    elapsed_s: float

    @property
    def step_s(self) -> float:
        """The median timed step of the slowest rank (every rank's step ends together in a
        synchronous run, so they agree to a few per cent)."""
        return max(sorted(r["step_seconds"])[len(r["step_seconds"]) // 2] for r in self.reports)

    def calls(self, rank: int = 0) -> Dict[str, int]:
        """Communication calls per step of one rank, by category (deterministic)."""
        return {k: int(round(v)) for k, v in sorted(self.reports[rank]["calls"].items())}

    @property
    def on_gpu(self) -> bool:
        return any(r.get("device", "cpu").startswith("cuda") for r in self.reports)


# ``launch/train_gpt.py``'s flags for each training precision (Megatron-LM's ``--bf16``, ``--fp16``).
PRECISIONS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16"]}


def precision_flags(dtype: str) -> List[str]:
    """``train_gpt.py`` flags of a ``dtype``: ``fp32`` none, ``bf16`` ``--bf16``, ``fp16``
    ``--fp16``."""
    if dtype not in PRECISIONS:
        raise ValueError(f"dtype must be one of {', '.join(PRECISIONS)}, got {dtype!r}")
    return list(PRECISIONS[dtype])


def training_flags(tc) -> List[str]:
    """``train_gpt.py`` flags of a :class:`mpu_lab.perf.calibrate.TrainConfig`, without its
    metrics file."""
    return tc.argv()


def format_utilisation(runs: Dict[str, ProfiledRun]) -> str:
    """Per run: each rank's mean utilisation over the timed steps; for CPU percentages also the
    job's total and how much of the machine other processes took meanwhile (contention: it
    slows the run), for the runnable share how busy the whole machine was."""
    lines = []
    for label, run in runs.items():
        util = run.utilisation
        means = util.mean()
        ranks = "  ".join(f"rank {r} {v:3.0f}%" for r, v in means.items())
        machine = sum(util.machine) / len(util.machine) if util.machine else None
        if util.kind == "cpu":
            line = f"{label}: {ranks}  | job {sum(means.values()):4.0f}%"
            if machine is not None:
                line += (f" of {100 * util.cores}% ({util.cores} cores); other processes "
                         f"{max(0.0, machine * util.cores - sum(means.values())):3.0f}%")
        else:
            line = f"{label}: {ranks}"
            if machine is not None:
                line += f"  | machine {machine:3.0f}% busy ({util.cores} cores)"
        lines.append(line)
    return "\n".join(lines)


def profile_training(flags: Sequence, nproc: int, label: str = "", interval_s: float = 0.05,
                     barrier: bool = False, cpu_metric: str = "cpu", pin: bool = False,
                     **run_kwargs) -> ProfiledRun:
    """Run ``launch/train_gpt.py`` with ``flags`` plus ``--breakdown`` (or
    ``--breakdown-barrier``) on ``nproc`` ranks under a :class:`UtilisationSampler`
    (``cpu_metric``: see :class:`Utilisation`; ``pin``: each rank on a core of its own)."""
    flags = [str(f) for f in flags] + ["--breakdown-barrier" if barrier else "--breakdown"]
    training.validate_args(training.parse_args(flags), nproc)   # a bad line fails here
    run_kwargs.setdefault("show", "none")
    job, util = run_with_utilisation("train_gpt.py", flags, nproc=nproc, interval_s=interval_s,
                                     cpu_metric=cpu_metric, pin=pin, **run_kwargs)
    reports = breakdowns(job.results)
    return ProfiledRun(label, nproc, reports, util.crop(*training_window(reports)),
                       job.results[0]["metrics"], job.elapsed_s)



# The model's causes next to the breakdown's categories.
_MODEL_TO_MEASURED = {"compute": (COMPUTE,), "tp_comm": ("tp all_reduce", "tp all_gather",
                      "tp reduce_scatter", "tp broadcast"), "pp_p2p+bubble": ("pp p2p",),
                      "dp_comm": ("dp all_reduce",)}


def measured_vs_predicted(run: ProfiledRun, prediction) -> Dict[str, Any]:
    """A measured run next to the cost model's prediction for it
    (:class:`mpu_lab.perf.cost_model.IterationPrediction`): step seconds, their ratio, and per
    cause the predicted seconds and the measured seconds of the matching categories (rank 0; the
    measured p2p time holds the bubble, so it is compared with the model's p2p + bubble)."""
    pred = prediction.breakdown()
    pred["pp_p2p+bubble"] = pred.pop("pp_p2p") + pred.pop("bubble")
    pred["compute"] += pred.pop("optimizer")
    parts = run.reports[0]["parts"]
    causes = {k: dict(predicted_s=pred.get(k, 0.0),
                      measured_s=sum(parts.get(c, 0.0) for c in cats))
              for k, cats in _MODEL_TO_MEASURED.items()}
    return dict(label=run.label, measured_s=run.step_s, predicted_s=prediction.total_s,
                ratio=run.step_s / prediction.total_s, causes=causes)


def format_measured_vs_predicted(rows: Sequence[Dict[str, Any]]) -> str:
    """Rows of :func:`measured_vs_predicted` as a table, milliseconds."""
    causes = list(_MODEL_TO_MEASURED)
    wide = max([len("run")] + [len(r["label"]) for r in rows]) + 2
    lines = [f"{'run':<{wide}}{'measured ms':>12}{'predicted ms':>13}{'ratio':>7}"]
    for r in rows:
        lines.append(f"{r['label']:<{wide}}{r['measured_s'] * 1e3:12.1f}"
                     f"{r['predicted_s'] * 1e3:13.1f}{r['ratio']:7.2f}")
    # the causes in a second table, each run by its name before the colon ("bad", "remedy")
    name = {r["label"]: r["label"].split(":")[0] for r in rows}
    short = max([len("run")] + [len(n) for n in name.values()]) + 2
    lines += ["", "ms per step by cause, measured / predicted:",
              f"{'run':<{short}}" + "".join(f"{c:>19}" for c in causes)]
    for r in rows:
        cells = [f"{r['causes'][c]['measured_s'] * 1e3:.1f} / {r['causes'][c]['predicted_s'] * 1e3:.1f}"
                 for c in causes]
        lines.append(f"{name[r['label']]:<{short}}" + "".join(f"{c:>19}" for c in cells))
    return "\n".join(lines)


_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}   # the labs' names


def compare_with_model(configs: Dict[str, Any], runs: Dict[str, ProfiledRun],
                       bandwidth_rows: Sequence[Dict[str, Any]],
                       dtype: str = "bfloat16") -> List[Dict[str, Any]]:
    """Predict each measured run with the cost model calibrated on this machine and put the
    two side by side (:func:`measured_vs_predicted`); each row also holds the ``prediction``
    (for :func:`mpu_lab.perf.op_classes.compare_terms`).

    ``configs``: label -> :class:`mpu_lab.perf.calibrate.TrainConfig` (the shapes of the runs
    in ``runs``, same labels). The all-reduce latency and bandwidth are fitted
    (:func:`allreduce_fit`) on ``bandwidth_rows`` of ``launch/bench_bandwidth.py`` at the same
    number of ranks. The compute side:

    * CPU runs (:func:`mpu_lab.perf.calibrate.cpu_cluster`): the matmul FLOP/s of each model's
      own layer GEMMs and the memory bandwidth, measured here with the threads each rank gets
      and scaled by the share of a core each rank gets when there are more ranks than cores;
      fp32: 4-byte activations and gradients.
    * GPU runs (:func:`mpu_lab.perf.calibrate_gpu.gpu_cluster_from`): the same GEMMs in
      ``dtype`` (``"bf16"`` or ``"bfloat16"``, ...) timed with CUDA events on this process's GPU and a device copy, each rank's
      share of a GPU it shares; 2-byte activations for a 16-bit ``dtype``, 4-byte gradients.
    """
    on_gpu = any(run.on_gpu for run in runs.values())
    dtype = _TORCH_DTYPES.get(dtype, dtype)
    fit = allreduce_fit(bandwidth_rows)
    cores = os.cpu_count() or 1
    rows = []
    for label, tc in configs.items():
        run = runs[label]
        if run.nproc != fit["nproc"]:
            raise ValueError(f"{label}: {run.nproc} ranks, but the bandwidth rows were measured "
                             f"on {fit['nproc']}")
        model, cfg = tc.shapes()
        shapes = calibrate.layer_matmul_shapes(model, cfg)
        if on_gpu:
            measured = device_calibration(shapes, dtype=dtype)
            cluster = gpu_cluster_from(dict(measured, latency_s=fit["latency_s"],
                                            busbw=fit["busbw"]), run.nproc)
            flops, act_bytes = float(measured["matmul_flops"]), 4 if dtype == "float32" else 2
        else:
            threads, share = max(1, cores // run.nproc), min(1.0, cores / run.nproc)
            flops = share * calibrate.calibrate_matmul(shapes, threads=threads)
            memory = share * calibrate.calibrate_memory_bandwidth(threads=threads)
            cluster = calibrate.cpu_cluster(run.nproc, calibration=dict(
                nproc=run.nproc, matmul_flops=flops, memory_bandwidth=memory,
                latency_s=fit["latency_s"], busbw=fit["busbw"]))
            act_bytes = 4
        pred = predict_iteration(model, cfg, cluster, dtype_bytes=act_bytes, grad_bytes=4)
        rows.append(dict(measured_vs_predicted(run, pred), matmul_gflops=flops / 1e9,
                         prediction=pred))
    return rows
