"""One small ``launch/train_gpt.py`` run, and its step time measured.

:class:`TrainConfig` holds a run's model shape and parallel sizes (``argv()`` gives its flags,
``shapes()`` the cost model's inputs, ``tiny()`` the same run at a width where arithmetic
vanishes); :func:`measure_step_time` runs it under torchrun and reads its per-iteration times;
:func:`cpu_pressure_us` says how much other processes competed for the CPU meanwhile.
:mod:`mpu_lab.perf.calibrate` sets such runs against the cost model.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from mpu_lab import launcher, training
from mpu_lab.core.models.gpt.gpt_model import pad_vocab_size
from mpu_lab.perf.cost_model import ModelShape, ParallelConfig

__all__ = ["TrainConfig", "cpu_pressure_us", "measure_step_time"]


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
    bf16: bool = False          # --bf16 (autocast); what a GPU run is calibrated in

    @property
    def nproc(self) -> int:
        return self.tp * self.pp * self.dp

    def tiny(self) -> "TrainConfig":
        """The same run (layers, parallel sizes, micro-batches, tokens, heads) at a width where
        arithmetic vanishes: hidden size 2 per head, a 16-word vocabulary (padded as usual).
        Every op, Python line and collective call is still there, so its step time is the
        host's work that does not scale with the width (:func:`mpu_lab.perf.calibrate.host_overhead`)."""
        return dataclasses.replace(self, hidden_size=2 * self.num_attention_heads, vocab_size=16)

    def label(self) -> str:
        return f"t={self.tp} p={self.pp} d={self.dp} h={self.hidden_size} L={self.num_layers}"

    def shapes(self) -> Tuple[ModelShape, ParallelConfig]:
        # the vocabulary train_gpt.py builds from these flags: padded to a multiple of
        # make_vocab_size_divisible_by x t (Megatron's rule; the training arguments' default)
        args = training.parse_args(self.argv())
        vocab = pad_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                               args.tensor_model_parallel_size)
        model = ModelShape(self.num_layers, self.hidden_size, self.num_attention_heads,
                           self.seq_length, vocab)
        cfg = ParallelConfig(tp=self.tp, pp=self.pp, dp=self.dp,
                             micro_batch_size=self.micro_batch_size,
                             global_batch_size=self.global_batch_size,
                             sequence_parallel=self.sequence_parallel)
        return model, cfg

    def argv(self, metrics_file: Optional[str] = None) -> List[str]:
        """``train_gpt.py`` flags of this run; ``--metrics-file`` only when one is given."""
        args = ["--tensor-model-parallel-size", self.tp, "--pipeline-model-parallel-size",
                self.pp, "--num-layers", self.num_layers, "--hidden-size", self.hidden_size,
                "--num-attention-heads", self.num_attention_heads, "--seq-length",
                self.seq_length, "--vocab-size", self.vocab_size, "--micro-batch-size",
                self.micro_batch_size, "--global-batch-size", self.global_batch_size,
                "--train-iters", self.train_iters, "--log-interval", 1, "--quiet"]
        if metrics_file is not None:
            args += ["--metrics-file", metrics_file]
        if self.sequence_parallel:
            args.append("--sequence-parallel")
        if self.bf16:
            args.append("--bf16")
        return [str(a) for a in args]


def cpu_pressure_us() -> Optional[float]:
    """Linux pressure-stall information: total µs during which some task waited for a CPU
    (``/proc/pressure/cpu``, "some" line); None where the kernel does not provide it. The
    difference over a run divided by its length is the share of time the CPU was contended."""
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some"):
                    return float(line.split("total=")[1])
    except (OSError, IndexError, ValueError):
        return None
    return None


def measure_step_time(tc: TrainConfig, skip: int = 4, timeout_s: float = 180
                      ) -> Dict[str, float]:
    """Step time of a real ``train_gpt.py`` run from its ``iteration_time_s`` lines (the first
    ``skip`` logged iterations are warm-up): ``best`` (the fastest iteration — what the machine
    does when nothing else runs), ``median``, and ``cpu_pressure`` — the share of the run during
    which some task waited for a CPU (:func:`cpu_pressure_us`; None if unknown). Our own ranks
    fit the cores here, so pressure means other processes were competing."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "metrics.jsonl")
        p0, t0 = cpu_pressure_us(), time.perf_counter()
        launcher.run("train_gpt.py", tc.argv(path), nproc=tc.nproc, show="none",
                   timeout_s=timeout_s)
        p1, t1 = cpu_pressure_us(), time.perf_counter()
        with open(path) as f:
            times = [json.loads(line)["iteration_time_s"] for line in f if line.strip()]
    times = sorted(times[skip:] or times)
    pressure = None if p0 is None or p1 is None else (p1 - p0) / 1e6 / (t1 - t0)
    return dict(best=times[0], median=times[len(times) // 2], cpu_pressure=pressure)
