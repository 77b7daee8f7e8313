"""Timelines of real runs: ``launch/train_gpt.py --pipeline-schedule S --timeline-file PATH``
writes the actions each pipeline rank executed in its last iteration (``F``, ``B``, ``W``, or
``BW`` where the backward is not split); :func:`run_timeline` starts that job and reads the file.

The actions carry no times. :func:`unit_clock` places them on the unit clock of
:func:`mpu_lab.perf.pipeline_schedules.simulate` (``F = B = W = 1``, ``BW = 2``, each action as
early as its inputs and its rank's order allow): the chart of the order the ranks really ran.
:func:`peak_in_flight` counts what each rank holds: micro-batches whose forward ran and whose
weight gradient has not (a deferred ``W`` keeps the layer inputs and output gradients it needs).
"""
from __future__ import annotations

import json
import pathlib
import tempfile
from fractions import Fraction
from typing import Dict, List, Optional

from mpu_lab import launcher
from mpu_lab.core.pipeline_parallel.action_lists import (
    ACTION_LIST_SCHEDULES, CHUNKS_PER_RANK, STAGE_LAYOUT, Action, pipeline_actions)
from mpu_lab.perf.pipeline_order import schedule_order
from mpu_lab.perf.pipeline_schedules import Slot, simulate

# the GPT of the runs: tiny, so a run is its start-up; hidden 32, 4 heads
MODEL_FLAGS = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
               "--micro-batch-size", "1", "--vocab-size", "128",
               "--make-vocab-size-divisible-by", "32", "--train-iters", "1", "--quiet"]
RUN_SCHEDULES = ("1F1B", "ZBH1", "ZBVZeroBubble", "DualPipeV")


def layers_for(pp: int) -> int:
    """Two layers per V chunk: ``4p`` layers, divisible into ``p`` stages and ``2p`` chunks."""
    return 4 * pp


def run_timeline(schedule: str, pp: int, microbatches: int, env: Optional[dict] = None,
                 folder: Optional[pathlib.Path] = None) -> Dict[int, List[Action]]:
    """Train the tiny GPT one iteration on ``pp`` ranks (one pipeline) under ``schedule`` and
    return ``{pipeline rank: [Action, ...]}`` from its ``--timeline-file`` (written into
    ``folder``, else into a temporary folder removed afterwards)."""
    if schedule not in RUN_SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: choose one of {list(RUN_SCHEDULES)}")
    if folder is None:
        with tempfile.TemporaryDirectory(prefix="zero_bubble_") as tmp:
            return run_timeline(schedule, pp, microbatches, env, pathlib.Path(tmp))
    path = pathlib.Path(folder) / f"{schedule}.json"
    args = ["--pipeline-model-parallel-size", str(pp), "--num-layers", str(layers_for(pp)),
            "--global-batch-size", str(microbatches), "--pipeline-schedule", schedule,
            "--timeline-file", str(path), *MODEL_FLAGS]
    launcher.run("train_gpt.py", args, nproc=pp, show="none", env=env)
    return read_timeline(path)


def read_timeline(path) -> Dict[int, List[Action]]:
    """A ``--timeline-file`` as ``{pipeline rank: [Action, ...]}``."""
    raw = json.loads(pathlib.Path(path).read_text())
    return {int(r): [Action(k, int(mb), int(c)) for k, mb, c in acts] for r, acts in raw.items()}


def planned(schedule: str, pp: int, microbatches: int) -> Dict[int, List[Action]]:
    """What the schedule prescribes: the mirror's action lists, or the planner's 1F1B order."""
    if schedule in ACTION_LIST_SCHEDULES:
        return pipeline_actions(schedule, pp, microbatches)
    return {r: [Action("BW" if op.kind == "B" else "F", op.microbatch, op.chunk)
                for op in schedule_order(schedule, pp, r, microbatches)] for r in range(pp)}


def layout_of(schedule: str) -> str:
    return STAGE_LAYOUT.get(schedule, "loop")


def chunks_of(schedule: str) -> int:
    return CHUNKS_PER_RANK.get(schedule, 1)


def unit_clock(actions: Dict[int, List[Action]], schedule: str) -> Dict[int, List[Slot]]:
    """The executed order placed on the unit clock (``F = B = W = 1``, ``BW = 2``)."""
    return simulate(actions, layout_of(schedule))


def idle_of(placed: Dict[int, List[Slot]]) -> List[int]:
    """Makespan minus each rank's busy slots, in rank order."""
    makespan = max(s.end for slots in placed.values() for s in slots)
    return [makespan - sum(s.end - s.start for s in placed[r]) for r in sorted(placed)]


def peak_in_flight(actions: Dict[int, List[Action]], schedule: str) -> List[Fraction]:
    """Per rank, the most micro-batches' worth of one stage it holds at once: a forward adds
    ``1 / chunks`` (a V chunk is half a stage), its ``W`` (or ``BW``) takes it away."""
    step = Fraction(1, chunks_of(schedule))
    out = []
    for r in sorted(actions):
        held = peak = Fraction(0)
        for a in actions[r]:
            held += step if a.kind == "F" else -step if a.kind in ("W", "BW") else 0
            peak = max(peak, held)
        out.append(peak)
    return out


def text(actions: List[Action], chunks: int = 1) -> str:
    """``F0 B0 W0 ...`` (``F3.1``: micro-batch 3 on chunk 1 when a rank holds two)."""
    return " ".join(f"{a.kind}{a.microbatch}" + (f".{a.chunk}" if chunks > 1 else "")
                    for a in actions)
