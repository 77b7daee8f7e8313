"""The capstone's run: start ``launch/capstone.py`` under torchrun through
:func:`mpu_lab.launcher.run`, turn the ranks' reports into the lines a learner reads (one per
piece, then the verdict) and draw the two loss curves."""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Dict, List, Optional

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from mpu_lab import launcher
from mpu_lab.labkit.capstone.args import check_args, parse_args

SCRIPT = "capstone.py"
TIMEOUT_S = 600.0


@dataclasses.dataclass
class CapstoneResult:
    """What a capstone run found. ``exit_code`` 0: the losses (and gradient norms) are equal;
    1: they part (or the job failed). ``lines``: what was printed; ``first_parting``:
    ``(iteration, "loss" | "grad_norm")``; ``culprit``: ``file:name`` of the first piece that
    differs, when they part."""
    exit_code: int
    lines: List[str]
    mirror_losses: List[float]
    learner_losses: List[float]
    first_parting: Optional[tuple] = None
    culprit: Optional[str] = None
    elapsed_s: float = 0.0


def piece_lines(reports: List[dict]) -> List[str]:
    """``used: <file>:<name> xN`` (``... (as <piece>)`` for a lab's build that stands for the
    piece, :data:`mpu_lab.training.code_folder.LAB_BUILDS`) or ``missing: <name> (the mirror's
    is used)`` per piece; N summed over one copy of the model (the ranks of tensor- and
    data-parallel rank 0, every pipeline stage)."""
    first = reports[0]
    copy = [r for r in reports if r["tp_rank"] == 0 and r["dp_rank"] == 0]
    lines = []
    for name in first["pieces"]:
        if name in first["found"]:
            n = sum(r["counts"].get(name, 0) for r in copy)
            built = first.get("defined_as", {}).get(name)     # lab 11's loop for the schedule
            lines.append(f"used: {first['found'][name]}:{built or name} x{n}"
                         + (f" (as {name})" if built else ""))
        else:
            lines.append(f"missing: {name} (the mirror's is used)")
    return lines


WHAT = {"loss": "losses", "grad_norm": "gradient norms"}


def verdict(report: dict) -> tuple:
    """``(exit code, line, culprit)`` from one rank's report."""
    runs, tol = report["runs"], report["tolerance"]
    mirror, learner = runs["mirror"], runs["learner"]
    if report["first_parting"] is None:
        return 0, (f"capstone: losses equal the mirror's within {tol:g} over "
                   f"{len(mirror['loss'])} iterations"), None
    at, what = report["first_parting"]
    head = (f"capstone: {WHAT[what]} part from the mirror's at iteration {at} (yours "
            f"{learner[what][at - 1]:.6f}, the mirror's {mirror[what][at - 1]:.6f})")
    found = report["verdicts"]
    if not found:
        return 1, head + ("; no piece differs on its own: look at how your pieces work "
                          "together"), None
    v = found[0]
    culprit = f"{v['file']}:{v['piece']}"
    if v["where"] == "training":
        why = (f"swapped in alone, its {WHAT[v['what']]} part at iteration {v['iteration']}")
    else:
        why = (f"on the same inputs as the mirror's, its {v['where']} differs "
               f"(relative {v['difference']:.2g})")
    others = [f"{o['file']}:{o['piece']}" for o in found[1:]]
    tail = f"; also differ: {', '.join(others)}" if others else ""
    return 1, f"{head}: the piece is {culprit} ({why}){tail}", culprit


def plot_losses(mirror: List[float], learner: List[float], path) -> pathlib.Path:
    """Your losses over the mirror's, one point per iteration, saved to ``path``."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3))
    steps = range(1, len(mirror) + 1)
    ax.plot(steps, mirror, "-", lw=4, alpha=0.4, label="the mirror's pieces")
    ax.plot(steps, learner, "o--", label="your pieces")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def run_capstone(code, tensor_model_parallel_size: int = 2, pipeline_model_parallel_size: int = 2,
                 data_parallel_size: int = 1, train_iters: int = 3, plot=None,
                 sequence_parallel: bool = False, tolerance: float = 1e-5, echo: bool = True,
                 timeout_s: float = TIMEOUT_S, backend: str = "auto") -> CapstoneResult:
    """Run the capstone from a notebook or a script; prints its lines when ``echo``. Raises
    ``FlagError`` for flags that cannot work (before any process starts). ``backend``:
    ``"auto"`` (the ranks' own choice, :func:`mpu_lab.training.initialize.init`), ``"gloo"``
    or ``"nccl"``."""
    argv = ["--code", str(code), "--tensor-model-parallel-size", str(tensor_model_parallel_size),
            "--pipeline-model-parallel-size", str(pipeline_model_parallel_size),
            "--data-parallel-size", str(data_parallel_size), "--train-iters", str(train_iters),
            "--tolerance", str(tolerance)] + (["--plot", str(plot)] if plot else []) \
        + (["--sequence-parallel"] if sequence_parallel else [])
    return run_checked(parse_args(argv), echo=echo, timeout_s=timeout_s, backend=backend)


def run_checked(a, echo: bool = True, timeout_s: float = TIMEOUT_S,
                backend: str = "auto") -> CapstoneResult:
    """:func:`run_capstone` for flags already parsed and checked."""
    check_args(a)
    nproc = a.tensor_model_parallel_size * a.pipeline_model_parallel_size * a.data_parallel_size
    job = ["--code", str(pathlib.Path(a.code).resolve()),
           "--tensor-model-parallel-size", str(a.tensor_model_parallel_size),
           "--pipeline-model-parallel-size", str(a.pipeline_model_parallel_size),
           "--train-iters", str(a.train_iters), "--tolerance", str(a.tolerance)] \
        + (["--sequence-parallel"] if a.sequence_parallel else [])
    try:
        env = {} if backend == "auto" else {"MPU_LAB_BACKEND": backend}
        result = launcher.run(SCRIPT, job, nproc=nproc, timeout_s=timeout_s, show="none",
                              env=env)
    except launcher.LaunchError as e:
        lines = [f"capstone: the job failed before the losses could be compared: {e}"]
        if echo:
            print("\n".join(lines))
        return CapstoneResult(1, lines, [], [])
    reports: List[Dict] = result.results
    lines = piece_lines(reports)
    code, last, culprit = verdict(reports[0])
    mirror, learner = reports[0]["runs"]["mirror"]["loss"], reports[0]["runs"]["learner"]["loss"]
    if a.plot:
        lines.append(f"plot: {plot_losses(mirror, learner, a.plot)}")
    lines.append(last)
    if echo:
        print("\n".join(lines))
    parted = reports[0]["first_parting"]
    return CapstoneResult(code, lines, mirror, learner, tuple(parted) if parted else None,
                          culprit, result.elapsed_s)
