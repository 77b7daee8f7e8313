"""This rank's two model chunks for a V pipeline schedule (``ZBVZeroBubble``, Qi et al. 2024
§6; ``DualPipeV``): stage ``r`` as chunk 0 and stage ``2p - 1 - r`` as chunk 1, of ``2p`` stages of
``L / 2p`` layers (:func:`mpu_lab.core.pipeline_parallel.partition.v_stage_table`). Rank 0
holds the embedding (chunk 0) and the output layer with the loss (chunk 1).

Each chunk is :func:`~mpu_lab.core.models.gpt.build_model_chunks`'s stage of a ``2p``-stage
pipeline, built from the same default-generator state, so both hold exactly the weights of the
one-stage model (that function replays the draws before a stage's first layer).
"""
from __future__ import annotations

from typing import List

import torch

from mpu_lab.core import parallel_state
from mpu_lab.core.models.gpt.gpt_model import build_model_chunks
from mpu_lab.core.pipeline_parallel.partition import V_SCHEDULES, canonical_schedule, check_layers_v


def build_v_model_chunks(config, vocab_size: int, max_sequence_length: int,
                         pipeline_model_parallel_size: int, pipeline_model_parallel_rank: int,
                         **gpt_kwargs) -> List[torch.nn.Module]:
    """``[chunk 0, chunk 1]`` of ``pipeline_model_parallel_rank`` in a V; the output weight of
    rank 0's chunk 1 is its own draw: call
    :func:`~mpu_lab.core.pipeline_parallel.sync_embedding_weights` after (rank 0 copies it
    from its chunk 0)."""
    p, r = pipeline_model_parallel_size, pipeline_model_parallel_rank
    check_layers_v(config.num_layers, p)
    start = torch.random.get_rng_state()        # both stages draw from the same start
    chunks = []
    for stage in (r, 2 * p - 1 - r):
        torch.random.set_rng_state(start)
        chunks += build_model_chunks(config, vocab_size, max_sequence_length,
                                     pipeline_model_parallel_size=2 * p,
                                     pipeline_model_parallel_rank=stage,
                                     virtual_pipeline_model_parallel_size=1, **gpt_kwargs)
    return chunks


def build_model_chunks_for_schedule(config, vocab_size: int, max_sequence_length: int,
                                    schedule=None, **gpt_kwargs) -> List[torch.nn.Module]:
    """This rank's chunks for ``schedule`` (a ``--pipeline-schedule`` name, None for the
    default): the V's two for ``ZBVZeroBubble`` and ``DualPipeV``, else
    :func:`~mpu_lab.core.models.gpt.build_model_chunks`'s (one, or ``v`` interleaved)."""
    if schedule is not None and canonical_schedule(schedule) in V_SCHEDULES:
        return build_v_model_chunks(config, vocab_size, max_sequence_length,
                                    parallel_state.get_pipeline_model_parallel_world_size(),
                                    parallel_state.get_pipeline_model_parallel_rank(),
                                    **gpt_kwargs)
    return build_model_chunks(config, vocab_size, max_sequence_length, **gpt_kwargs)
