"""``--timeline-file PATH``: the actions each pipeline rank ran in the last iteration, in order,
as one JSON object ``{"<pipeline rank>": [[kind, microbatch, chunk], ...]}`` — ``kind`` ``F``
(forward), ``B`` (input gradient), ``W`` (weight gradient), or ``BW`` where the schedule does
not split the backward (GPipe, 1F1B, Interleaved1F1B).

The actions are what the schedule reported through its ``action_callback`` as it ran them
(:class:`~mpu_lab.training.training.Callback`'s ``on_pipeline_action``): Megatron's loops for
1F1B and interleaving, the action-list runtime for ZBH1, ZBVZeroBubble and DualPipeV (whose overlapped pair is a
forward and a ``BW``, run one after the other). The pipeline that
holds global rank 0 writes the file (the data-parallel replicas run the same order); its folder
is created when missing.
"""
from __future__ import annotations

import json
import pathlib
from typing import List

import torch.distributed as dist

from mpu_lab.core import parallel_state
from mpu_lab.training.training import Callback


class PipelineTimelineFile(Callback):
    """Collect this rank's actions of every step; after the step that reaches
    ``args.train_iters``, gather them over the pipeline group and write ``path``."""

    def __init__(self, path: str):
        self.path = pathlib.Path(path)
        self.actions: List[list] = []

    def on_step_begin(self, state) -> None:
        self.actions = []

    def on_pipeline_action(self, kind: str, microbatch: int, chunk: int) -> None:
        self.actions.append([kind, int(microbatch), int(chunk)])

    def on_step_end(self, state, step) -> None:
        if state.iteration == state.args.train_iters:
            write_timeline_file(self.path, self.actions)


def write_timeline_file(path: pathlib.Path, actions: List[list]) -> None:
    """Gather ``actions`` of every pipeline rank (collective over the pipeline group) and write
    them on global rank 0."""
    group = parallel_state.get_pipeline_model_parallel_group()
    everyone: List[list] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(everyone, actions, group=group)
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({str(r): acts for r, acts in enumerate(everyone)}))
