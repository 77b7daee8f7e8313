"""A real pipeline run's timeline, recorded from outside the schedule, and its bubble.

    recorder = ScheduleRecorder(model_chunks, num_microbatches, schedule="1f1b")
    losses = forward_backward_func(...)            # the schedule runs as always
    recorder.records         # [(kind, microbatch, chunk, start_s, end_s), ...] of the last iteration
    recorder.peak_in_flight  # most micro-batch activations held at once
    recorder.report()        # JSON-able, for launcher.report; pipeline_records() collects the ranks'
    recorder.remove()

``train_gpt.py --record-timeline`` installs one on every rank and reports its last iteration.
:mod:`mpu_lab.core.pipeline_parallel.schedules` knows nothing of it. The recorder watches the model
chunks with torch's own hooks:

* a forward pre-hook and a forward hook on each chunk time its forward. A chunk runs its
  micro-batches in order (it draws them from its data iterator one by one), so the ``k``-th
  forward of chunk ``c`` in an iteration is micro-batch ``k``; an iteration starts with the
  forward of micro-batch 0 on chunk 0;
* a hook on the forward's output tensor fires when autograd reaches it: the start of that
  micro-batch's backward through the chunk, which says which micro-batch and chunk it is;
* a post-accumulate-grad hook on every parameter marks how far that backward has got; the last
  one to fire is its end.

Times are ``time.time()``, one clock for all ranks of a machine; on a GPU each one is taken
after ``torch.cuda.synchronize()``, so a box is the kernels' time, not their launch.
:func:`measured_bubble` sets the idle share of such a timeline beside the formula's; on an
oversubscribed CPU, where a rank also waits for a core, it is not a bubble.
:mod:`mpu_lab.perf.pipeline_bubble` measures one that is: each rank on a core of its own.
"""
from __future__ import annotations

import functools
import time
from typing import Dict, List, Optional, Sequence

import torch

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state as ps
from mpu_lab.perf.pipeline_simulation import Record, analytic_bubble, bubble_share
from mpu_lab.core.pipeline_parallel.utils import model_chunks_of, unwrap_model


class ScheduleRecorder:
    """Records the forwards and backwards that a pipeline schedule runs on this rank's
    ``model_chunks`` (one module or a list), ``num_microbatches`` per chunk and iteration."""

    def __init__(self, model_chunks, num_microbatches: int, schedule: Optional[str] = None):
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) \
                or num_microbatches < 1:
            raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
        self.chunks = [unwrap_model(chunk) for chunk in model_chunks_of(model_chunks)]
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.peak_in_flight = 0
        self._on_gpu = initialize.get_device().type == "cuda"
        self._records: List[Record] = []
        self._forwards = [0] * len(self.chunks)    # forwards run per chunk, all iterations
        self._forward: Optional[list] = None       # [kind, microbatch, chunk, start] running
        self._backward: Optional[list] = None      # [kind, microbatch, chunk, start, end] running
        self._held = 0
        self._handles = []
        for index, chunk in enumerate(self.chunks):
            self._handles.append(chunk.register_forward_pre_hook(
                functools.partial(self._forward_starts, index)))
            self._handles.append(chunk.register_forward_hook(
                functools.partial(self._forward_ends, index)))
            for param in chunk.parameters():
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(
                        self._gradient_accumulated))

    # ------------------------------------------------------------------ hooks
    def _now(self) -> float:
        if self._on_gpu:
            torch.cuda.synchronize()
        return time.time()

    def _close_backward(self) -> None:
        if self._backward is not None:
            self._records.append(tuple(self._backward))
            self._backward = None

    def _forward_starts(self, index: int, module, args) -> None:
        self._close_backward()
        microbatch = self._forwards[index] % self.num_microbatches
        if index == 0 and microbatch == 0:          # a new iteration
            self._records, self._held, self.peak_in_flight = [], 0, 0
        self._forwards[index] += 1
        self._forward = ["F", microbatch, index, self._now()]

    def _forward_ends(self, index: int, module, args, output) -> None:
        kind, microbatch, chunk, start = self._forward
        self._records.append((kind, microbatch, chunk, start, self._now()))
        self._forward = None
        tensor = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            self._held += 1
            self.peak_in_flight = max(self.peak_in_flight, self._held)
            tensor.register_hook(functools.partial(self._backward_starts, microbatch, chunk))

    def _backward_starts(self, microbatch: int, chunk: int, grad) -> None:
        self._close_backward()
        now = self._now()
        self._backward = ["B", microbatch, chunk, now, now]
        self._held -= 1

    def _gradient_accumulated(self, param) -> None:
        if self._backward is not None:
            self._backward[4] = self._now()

    # ------------------------------------------------------------------ results
    @property
    def records(self) -> List[Record]:
        """``(kind, microbatch, chunk, start_s, end_s)`` of the last iteration, in the order
        they ran (the forwards only, for a forward-only run)."""
        return self._records + ([tuple(self._backward)] if self._backward is not None else [])

    def report(self) -> Dict:
        """This rank's coordinates and timeline, JSON-able (for ``launcher.report``; see
        :func:`pipeline_records`)."""
        return dict(pipeline_parallel_rank=ps.get_pipeline_model_parallel_rank(),
                    tensor_parallel_rank=ps.get_tensor_model_parallel_rank(),
                    data_parallel_rank=ps.get_data_parallel_rank(),
                    pipeline_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                    schedule=self.schedule, num_microbatches=self.num_microbatches,
                    num_model_chunks=len(self.chunks), peak_in_flight=self.peak_in_flight,
                    records=[list(r) for r in self.records])

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "ScheduleRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def pipeline_records(reports: Sequence[Optional[Dict]], data_parallel_rank: int = 0,
                     tensor_parallel_rank: int = 0) -> Dict:
    """One pipeline's records out of a real run's per-rank reports.

    ``reports``: what the ranks reported, in rank order — e.g. ``job.results`` of
    ``mpu_lab.launcher.run("train_gpt.py", [..., "--record-timeline"], nproc=...)``, where each
    rank's result holds ``"timeline"`` (:meth:`ScheduleRecorder.report`); a report may also be
    that dict itself. Returns ``dict(records, num_microbatches, num_model_chunks, schedule,
    ranks, peak_in_flight)`` with ``records[k]`` the records of pipeline stage ``k`` (ready for
    ``mpu_lab.labkit.pipeline_parallel.viz.plot_gantt`` and :func:`measured_bubble`), ``ranks[k]`` its global
    rank and ``peak_in_flight[k]`` its most activations held.
    """
    stages = {}
    for rank, report in enumerate(reports):
        entry = (report or {}).get("timeline", report) if isinstance(report, dict) else None
        if not entry or "records" not in entry:
            continue
        if (entry["data_parallel_rank"], entry["tensor_parallel_rank"]) != \
                (data_parallel_rank, tensor_parallel_rank):
            continue
        stages[entry["pipeline_parallel_rank"]] = (rank, entry)
    if not stages:
        raise ValueError(f"no timeline for data-parallel rank {data_parallel_rank}, tensor-"
                         f"parallel rank {tensor_parallel_rank} in these reports: run with "
                         f"--record-timeline and --pipeline-model-parallel-size > 1")
    p = stages[min(stages)][1]["pipeline_parallel_size"]
    if sorted(stages) != list(range(p)):
        raise ValueError(f"timelines of pipeline stages {sorted(stages)} found, expected 0..{p - 1}")
    first = stages[0][1]
    return dict(records=[[tuple(r) for r in stages[k][1]["records"]] for k in range(p)],
                ranks=[stages[k][0] for k in range(p)], schedule=first["schedule"],
                num_microbatches=first["num_microbatches"],
                num_model_chunks=first["num_model_chunks"],
                peak_in_flight=[stages[k][1]["peak_in_flight"] for k in range(p)])


def measured_bubble(records: Sequence[Sequence[Record]], num_microbatches: int,
                    num_model_chunks: int = 1) -> Dict[str, float]:
    """The measured idle share of a real run beside the analytic one.

    ``records[r]`` are stage ``r``'s wall-clock records (one pipeline: stages in order). Time
    spent waiting for a message or for a CPU core counts as idle, so on an oversubscribed
    machine the measured share is larger than the formula's — indicative only.
    """
    analytic = analytic_bubble(len(records), num_microbatches, num_model_chunks)
    return dict(measured_share=float(bubble_share(records)),
                analytic_share=float(analytic["share"]),
                analytic_relative=float(analytic["relative"]))
