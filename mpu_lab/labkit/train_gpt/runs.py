"""Lab 14 and 15's GPT training runs: ``launch/train_gpt.py`` started from a notebook, its
losses, and the lecture's ``GPT_ARGS`` launch line.

* :func:`gpt_flags` — the small GPT's Megatron-style flags; :func:`command_line` — the
  ``torchrun`` line that runs them by hand;
* :func:`train` — one ``torchrun`` job through :func:`mpu_lab.launcher.run`, checked in this
  process first (:func:`mpu_lab.training.validate_args`), optionally with a live loss plot
  (:class:`mpu_lab.labkit.train_gpt.viz.LiveLossPlot`, redrawn from the ``--metrics-file`` as rank 0
  logs each iteration); returns a :class:`TrainRun` with the loss of every iteration;
* :func:`from_job` — the same from a job started with ``launcher.run("train_gpt.py", ...)``;
* :func:`max_relative_difference`, :func:`print_agreement`, :func:`first_iteration_apart`,
  :func:`print_losses` — compare runs that should coincide (TP = 1, 2, 4; a run resumed from a
  resharded checkpoint; EP = 1 and 2 until a rounding-level difference re-routes a token);
* :func:`throughput`, :func:`print_throughput` — tokens/s, achieved model FLOP/s and MFU of a
  run (the model FLOPs from :mod:`mpu_lab.perf.cost_model`, the peak from
  :mod:`mpu_lab.perf.hardware`); :func:`precision_flags`, :func:`agreement_rtol` — a run's
  ``dtype`` as flags, and how close two runs' losses must be in it;
* :data:`LECTURE_GPT_ARGS`, :func:`gpt_args_from_script`, :func:`print_side_by_side`,
  :func:`print_derived` — the lecture's line next to ``launch/train_gpt.sh``'s, and what
  :func:`~mpu_lab.training.validate_args` derives from a line for a given number of ranks.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import re
import statistics
import tempfile
import textwrap
from typing import Dict, List, Optional, Sequence, Tuple

from mpu_lab.training import checkpointing
from mpu_lab import launcher, training
from mpu_lab.labkit import REPO_ROOT
from mpu_lab.perf import hardware
from mpu_lab.perf.runs import precision_flags
from mpu_lab.perf.cost_model import ModelShape, flops_per_token, model_flops_per_iteration
from mpu_lab.labkit.train_gpt.viz import LiveLossPlot

# The lecture's launch line (COMP4901Y, "Launch Scripts"): the flags and values it passes.
LECTURE_GPT_ARGS = """
  --tensor-model-parallel-size 2
  --pipeline-model-parallel-size 2
  --sequence-parallel
  --num-layers 24
  --hidden-size 1024
  --num-attention-heads 16
  --seq-length 1024
  --max-position-embeddings 1024
  --micro-batch-size 4
  --global-batch-size 16
  --lr 0.00015
  --train-iters 500000
  --lr-decay-iters 320000
  --lr-decay-style cosine
  --min-lr 1.0e-5
  --weight-decay 1e-2
  --lr-warmup-fraction .01
  --clip-grad 1.0
  --fp16
"""


# --------------------------------------------------------------------------- flags
def gpt_flags(steps: int, layers: int = 2, hidden: int = 64, heads: int = 4,
              seq_length: int = 64, micro_batch: int = 8, **more) -> List[str]:
    """Flags for ``launch/train_gpt.py``: the model and schedule, a loss logged every
    iteration. ``more`` adds flags by keyword (``tensor_model_parallel_size=2``,
    ``sequence_parallel=True``)."""
    flags = ["--num-layers", layers, "--hidden-size", hidden, "--num-attention-heads", heads,
             "--seq-length", seq_length, "--micro-batch-size", micro_batch,
             "--train-iters", steps, "--log-interval", 1]
    for key, value in more.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value not in (None, False):
            flags += [flag, value]
    return [str(f) for f in flags]


# How close the losses of two runs that should coincide (TP = 1, 2, 4; a resumed run) must be,
# relative: fp32 sums in a different order per TP size (rounding ~1e-7); 16-bit activations
# round to 3 significant digits (bf16) or 4 (fp16), and a few hundred steps compound it.
AGREEMENT_RTOL = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 2e-2}


def agreement_rtol(dtype: str) -> float:
    """:data:`AGREEMENT_RTOL` of ``dtype``: what :func:`print_agreement` allows."""
    precision_flags(dtype)
    return AGREEMENT_RTOL[dtype]


WIDTH = 100    # the longest line the labs print


def fit(line: str, width: int = WIDTH) -> str:
    """``line`` as it is when it fits in ``width`` characters, else broken at spaces with the
    continuation lines indented four spaces."""
    if len(line) <= width:
        return line
    return textwrap.fill(line, width, subsequent_indent="    ", break_long_words=False,
                         break_on_hyphens=False)


def command_line(flags: Sequence, nproc: int, width: Optional[int] = None) -> str:
    """The same job typed into a terminal: one line, or, with ``width``, shell lines of at
    most ``width`` characters joined by `` \\``, a flag and its value kept together."""
    line = (f"torchrun --standalone --nproc-per-node {nproc} launch/train_gpt.py "
            + " ".join(map(str, flags)))
    if width is None or len(line) <= width:
        return line
    words = re.split(r" (?=--)", line)       # "--flag value" stays on one line
    lines = [words[0]]
    for word in words[1:]:
        if len(lines[-1]) + 1 + len(word) + 2 > width:
            lines[-1] += " \\"
            lines.append("    " + word)
        else:
            lines[-1] += " " + word
    return "\n".join(lines)


def split_flags(text: str) -> List[Tuple[str, Optional[str]]]:
    """``"--a 1 --b --c x"`` -> ``[("--a", "1"), ("--b", None), ("--c", "x")]`` (shell
    line continuations dropped)."""
    tokens = text.replace("\\\n", " ").replace("\\", " ").split()
    pairs: List[Tuple[str, Optional[str]]] = []
    for token in tokens:
        if token.startswith("--"):
            pairs.append((token, None))
        elif pairs and pairs[-1][1] is None:
            pairs[-1] = (pairs[-1][0], token)
        else:
            raise ValueError(f"value {token!r} follows no flag in {text!r}")
    return pairs


def gpt_args_from_script(path=REPO_ROOT / "launch" / "train_gpt.sh") -> str:
    """The text of the ``GPT_ARGS="..."`` assignment in a launch script."""
    text = pathlib.Path(path).read_text()
    match = re.search(r'^GPT_ARGS="(.*?)"', text, flags=re.MULTILINE | re.DOTALL)
    if not match:
        raise ValueError(f"{path} has no GPT_ARGS=\"...\" assignment")
    return match.group(1)


def print_side_by_side(left: str, right: str, titles=("lecture", "train_gpt.sh")) -> None:
    """Two launch lines flag by flag, in the left one's order (``-`` where one lacks a flag;
    a flag without a value shows as ``on``)."""
    a, b = dict(split_flags(left)), dict(split_flags(right))
    names = list(a) + [n for n in b if n not in a]
    show = lambda d, n: "-" if n not in d else ("on" if d[n] is None else d[n])  # noqa: E731
    width = max(len(n) for n in names)
    print(f"{'flag':<{width}}  {titles[0]:>10}  {titles[1]:>12}")
    for n in names:
        print(f"{n:<{width}}  {show(a, n):>10}  {show(b, n):>12}")


DERIVED = ("data_parallel_size", "num_micro_batches", "padded_vocab_size",
           "max_position_embeddings", "lr_warmup_steps", "lr_decay_iters")


def derived(text_or_flags, world_size: int) -> Dict[str, object]:
    """What :func:`mpu_lab.training.validate_args` works out from a launch line for
    ``world_size`` ranks (pure: no process starts). Raises ``ValueError`` naming the numbers
    when the line does not fit."""
    if isinstance(text_or_flags, str):
        flags = [x for pair in split_flags(text_or_flags) for x in pair if x is not None]
    else:
        flags = [str(f) for f in text_or_flags]
    args = training.validate_args(training.parse_args(flags), world_size, check_load=False)
    return {name: getattr(args, name) for name in DERIVED}


def print_derived(text_or_flags, world_size: int) -> None:
    """:func:`derived` as text, or the reason the line does not fit ``world_size`` ranks."""
    try:
        values = derived(text_or_flags, world_size)
    except ValueError as exc:
        print(fit(f"on {world_size} ranks this line is refused: {exc}"))
        return
    print(fit(f"on {world_size} ranks: " + ", ".join(f"{k} = {v}" for k, v in values.items())))


# --------------------------------------------------------------------------- running
@dataclasses.dataclass
class TrainRun:
    """One finished ``train_gpt.py`` job: the loss of each logged iteration (rank 0's; every
    rank logs the same loss), the ranks' reports and the wall time."""
    label: str
    iterations: List[int]
    losses: List[float]
    results: List[dict]
    elapsed_s: float
    nproc: int
    flags: Sequence[str] = ()          # the job's train_gpt.py flags (for throughput)

    @property
    def curve(self) -> Tuple[List[int], List[float]]:
        return self.iterations, self.losses

    @property
    def ranks_agree(self) -> bool:
        """Every rank logged exactly rank 0's losses."""
        return all([m["lm_loss"] for m in r["metrics"]] == self.losses for r in self.results)


def _read_metrics(path: str) -> List[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []


def _redraw(plot, metrics_file: str, rank: Optional[int], text: str) -> None:
    """``launcher.run``'s ``on_line``: when rank 0 logs an iteration, redraw from the file."""
    if rank == 0 and "lm loss" in text:
        rows = _read_metrics(metrics_file)
        plot.update([r["iteration"] for r in rows], [r["lm_loss"] for r in rows])


def train(flags: Sequence, nproc: int, label: Optional[str] = None, live: bool = False,
          env: Optional[Dict[str, str]] = None, timeout_s: float = 600.0) -> TrainRun:
    """Run ``launch/train_gpt.py flags`` on ``nproc`` ranks and return its losses.

    The flags are checked here first, so a bad line fails before any process starts.
    ``live``: draw the loss while the job runs (rank 0 appends each logged iteration to a
    temporary ``--metrics-file``; the plot is redrawn from it as rank 0's log lines arrive).
    """
    flags = [str(f) for f in flags]
    args = training.validate_args(training.parse_args(flags), nproc)
    label = label or f"TP={args.tensor_model_parallel_size}"
    on_line, plot, metrics_file = None, None, None
    if live:
        fd, metrics_file = tempfile.mkstemp(prefix="mpu_lab_metrics_", suffix=".jsonl")
        os.close(fd)
        flags += ["--metrics-file", metrics_file]
        plot = LiveLossPlot(f"{label}: lm loss while training ({nproc} ranks)",
                            args.train_iters, vocab_size=args.padded_vocab_size)
        on_line = functools.partial(_redraw, plot, metrics_file)
    else:
        flags.append("--quiet")
    try:
        job = launcher.run("train_gpt.py", flags, nproc=nproc, show="none", env=env,
                         timeout_s=timeout_s, on_line=on_line)
    finally:
        if metrics_file:
            os.unlink(metrics_file)
    run = from_job(job, label, flags)
    if plot is not None:
        plot.update(*run.curve, force=True)
    return run


def from_job(job: "launcher.LaunchResult", label: str, flags: Sequence = ()) -> TrainRun:
    """A :class:`TrainRun` from a finished ``launcher.run("train_gpt.py", flags, ...)`` job, whose
    ranks each reported ``{"metrics": [...], "iteration": n}``."""
    metrics = job.results[0]["metrics"]
    return TrainRun(label, [m["iteration"] for m in metrics], [m["lm_loss"] for m in metrics],
                    job.results, job.elapsed_s, job.nproc, [str(f) for f in flags])


# --------------------------------------------------------------------------- comparing
def _common(run: TrainRun, reference: TrainRun, last: Optional[int] = None):
    """(iteration, loss, reference loss) for the iterations both logged, up to ``last``."""
    ref = dict(zip(reference.iterations, reference.losses))
    common = [(i, v, ref[i]) for i, v in zip(run.iterations, run.losses)
              if i in ref and (last is None or i <= last)]
    if not common:
        raise ValueError(f"{run.label} and {reference.label} logged no iteration in common"
                         + ("" if last is None else f" up to iteration {last}"))
    return common


def max_relative_difference(run: TrainRun, reference: TrainRun,
                            last: Optional[int] = None) -> float:
    """Largest ``|loss - reference loss| / |reference loss|`` over the iterations both logged
    (up to iteration ``last``, where given)."""
    return max(abs(v - r) / abs(r) for _, v, r in _common(run, reference, last))


def first_iteration_apart(run: TrainRun, reference: TrainRun, rtol: float) -> Optional[int]:
    """The first common iteration whose losses differ by more than ``rtol`` relative, or None."""
    return next((i for i, v, r in _common(run, reference) if abs(v - r) > rtol * abs(r)), None)


def _padded_vocab(run: TrainRun) -> Optional[int]:
    return model_shape(run.flags, run.nproc).V if run.flags else None


def print_agreement(runs: Sequence[TrainRun], reference: TrainRun, rtol: float = 1e-5,
                    last: Optional[int] = None) -> bool:
    """One verdict line per run: does it follow ``reference`` within ``rtol`` relative on
    every common iteration (up to iteration ``last``, where given)? (The value itself is in
    the plot; it depends on the machine.)
    A run whose vocabulary is padded to another size (a multiple of 128 x its TP) is another
    model: it is named as such, not compared."""
    ok_all = True
    ref_rows = _padded_vocab(reference)
    for run in runs:
        rows = _padded_vocab(run)
        if rows != ref_rows:
            print(f"{run.label} vs {reference.label}: not compared: the vocabulary is padded to "
                  f"{rows} rows, not {ref_rows}, so it is another model (the extra rows take "
                  f"their own random draws, every weight after them differs, and the softmax "
                  f"has more dummy ids)")
            continue
        common = [i for i, _, _ in _common(run, reference, last)]
        ok = max_relative_difference(run, reference, last) <= rtol
        ok_all &= ok
        print(fit(f"{run.label} vs {reference.label}: iterations {common[0]}-{common[-1]}, max "
                  f"relative difference <= {rtol:g}: {'the same losses' if ok else 'DIFFERENT'}"))
    return ok_all


def print_losses(runs: Sequence[TrainRun], every: int = 10, first: Optional[int] = None) -> None:
    """Losses rounded to 4 decimals every ``every`` iterations (and the last), one column per
    run (``-`` where a run did not log that iteration), from iteration ``first`` on (default:
    the first logged; lab 14 starts its later tables at 10, since the first loss answers its
    prediction of section 2)."""
    logged = sorted({i for r in runs for i in r.iterations})
    if not logged:
        raise ValueError("print_losses: the runs logged no iteration")
    its = [i for i in logged if first is None or i >= first]
    if not its:
        raise ValueError(f"print_losses: first={first} is past every logged iteration (the runs "
                         f"logged iterations {logged[0]}-{logged[-1]}); use first <= {logged[-1]}")
    shown = [i for i in its if i % every == 0 or i in (its[0], its[-1])]
    widths = [max(7, len(r.label)) + 2 for r in runs]
    print(f"{'iteration':>9}" + "".join(f"{r.label:>{w}}" for r, w in zip(runs, widths)))
    for i in shown:
        cells = []
        for r, w in zip(runs, widths):
            loss = dict(zip(r.iterations, r.losses)).get(i)
            cells.append(f"{loss:>{w}.4f}" if loss is not None else f"{'-':>{w}}")
        print(f"{i:>9}" + "".join(cells))


def checkpoint_listing(save_dir) -> List[str]:
    """The ``iter_XXXXXXX`` folders (and Megatron's tracker file) under ``save_dir``, with
    what each checkpoint's marker says about it; paths relative to ``save_dir``."""
    root = pathlib.Path(save_dir)
    lines = []
    for path in sorted(root.iterdir()):
        if path.is_dir():
            info = checkpointing.read_checkpoint_info(path)
            lines.append(f"{path.name}/  iteration {info['iteration']}, saved at TP="
                         f"{info['tensor_model_parallel_size']}, "
                         f"{len(list(path.glob('*.distcp')))} shard files + .metadata")
        else:
            lines.append(f"{path.name}  ({path.read_text().strip()})")
    return lines


# --------------------------------------------------------------------------- speed
def model_shape(flags: Sequence, nproc: int) -> ModelShape:
    """The cost model's shape of the GPT these flags build (the vocabulary as padded)."""
    args = training.validate_args(training.parse_args([str(f) for f in flags]), nproc,
                                  check_load=False)
    return ModelShape(args.num_layers, args.hidden_size, args.num_attention_heads,
                      args.seq_length, args.padded_vocab_size)


def gpus_used(nproc: int) -> Tuple[int, Optional[str]]:
    """(GPUs the ranks of an ``nproc`` job run on, their name) as :mod:`mpu_lab.training.initialize`
    places them: rank r on GPU r mod the GPUs seen, so ranks share a GPU when there are fewer;
    ``(0, None)`` on the CPU (or with ``MPU_LAB_DEVICE=cpu``)."""
    import torch  # the notebook's kernel has it already; asked only here

    if os.environ.get("MPU_LAB_DEVICE") == "cpu" or not torch.cuda.is_available():
        return 0, None
    count = torch.cuda.device_count()
    return (min(nproc, count), torch.cuda.get_device_name(0)) if count else (0, None)


def throughput(run: TrainRun, skip: int = 1) -> Dict[str, object]:
    """tokens/s of a run (median over its logged iterations after the first ``skip``, which
    pay for warm-up), the model FLOP/s that makes (:func:`model_flops_per_iteration`:
    ``6N + 12·L·h·s`` per token) and, on a GPU in :data:`mpu_lab.perf.hardware.PEAKS`, MFU."""
    if not run.flags:
        raise ValueError(f"{run.label}: no flags recorded (make it with train or from_job(..., "
                         f"flags)), so its model is unknown")
    rows = [m for m in run.results[0]["metrics"] if "tokens_per_s" in m]
    rows = rows[skip:] if len(rows) > skip else rows
    tokens_per_s = statistics.median(m["tokens_per_s"] for m in rows)
    model = model_shape(run.flags, run.nproc)
    per_token = model_flops_per_iteration(model, 1) / model.s
    gpus, name = gpus_used(run.nproc)
    peak = hardware.lookup(name)
    achieved = tokens_per_s * per_token
    mfu = hardware.mfu(achieved, peak, gpus) if peak else None
    return dict(label=run.label, tokens_per_s=tokens_per_s, flops_per_token=per_token,
                achieved_flops=achieved, gpus=gpus, device=name, peak=peak, mfu=mfu,
                model=model)


def flop_formula(model: ModelShape) -> str:
    """The model FLOPs per token written out: ``6N + 12·L·h·s`` with this model's numbers (N:
    the weights each token is multiplied by, 12·L·h² + V·h)."""
    f = flops_per_token(model)
    attention = 3 * model.L * f["attention_core"]             # 12·L·h·s
    per_token = model_flops_per_iteration(model, 1) / model.s
    n = (per_token - attention) / 6
    return (f"model FLOPs per token = 6N + 12·L·h·s (Narayanan et al. 2021), N = 12·L·h² + V·h:"
            f" 6 x {n:,.0f} + 12 x {model.L} x {model.h} x {model.s} = {per_token:,.0f}")


def print_throughput(runs: Sequence[TrainRun], header: bool = True) -> None:
    """Per run: tokens/s, achieved TFLOP/s and MFU (or why there is no MFU); with ``header``
    first the FLOP formula and the peak MFU is measured against."""
    rows = [throughput(r) for r in runs]
    if header:
        print(flop_formula(rows[0]["model"]))
        print(hardware.describe(rows[0]["peak"], rows[0]["device"]))
    for row in rows:
        mfu = f"MFU {100 * row['mfu']:.1f} % of {row['gpus']} GPU(s)" if row["mfu"] is not None \
            else "MFU n/a"
        print(f"{row['label']}: {row['tokens_per_s']:,.0f} tokens/s, "
              f"{row['achieved_flops'] / 1e12:.3g} TFLOP/s achieved, {mfu}")
