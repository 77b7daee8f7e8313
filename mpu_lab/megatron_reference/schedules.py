"""Megatron-core's pipeline schedules side by side with mpu_lab's, on the same toy stages: the
rank side of ``launch/megatron_core_schedules.py`` (lab 11 starts it and prints the report with
:mod:`mpu_lab.labkit.pipeline_parallel.megatron_core`).

Each case runs one iteration of :mod:`mpu_lab.perf.pipeline_toy`'s tied-embedding model
cut into ``p`` stages (``v`` chunks each when interleaved) three times from the same weights
and micro-batches: through Megatron-core's schedule (``get_forward_backward_func`` of
``megatron.core.pipeline_parallel``), through mpu_lab's schedule of the same name, and as
the single-process twin (:class:`~mpu_lab.perf.pipeline_toy.ToyModel`). Each rank
reports the largest difference of its stage gradients (the tied embedding's after its
all-reduce over the embedding group) between Megatron-core and mpu_lab, and between each and
the twin. The cases (:data:`CASES`):

* ``1f1b`` — ``forward_backward_pipelining_without_interleaving``;
* ``interleaved`` — ``forward_backward_pipelining_with_interleaving`` with ``v = 2`` and
  ``batch_p2p_comm=False, overlap_p2p_comm=True``;
* ``interleaved-batched`` — the same with Megatron-core's default batched p2p
  (``batch_p2p_comm=True``): at ``p = 2`` the previous and the next stage are the same rank,
  and on gloo its gradients come out wrong, silently (a "going further" of lab 11).

Megatron-core runs in the job's ranks only, with the CPU patches of
:mod:`mpu_lab.megatron_reference.cpu`, never in the notebook's kernel. Where it cannot be
imported every rank reports ``{"skipped": <how to install it>}``. Checked with megatron-core 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state as ps
from mpu_lab.megatron_reference import runtime as mc
from mpu_lab.megatron_reference import cpu as megatron_core_cpu
from mpu_lab.core.pipeline_parallel import schedules
from mpu_lab.core.pipeline_parallel.tied_embeddings import allreduce_embedding_grads
from mpu_lab.perf.pipeline_toy import (
    ToyConfig, ToyModel, build_toy_model_chunks, toy_batches, toy_forward_step)


@dataclasses.dataclass(frozen=True)
class Case:
    """One schedule to compare: ``v`` model chunks per stage (1: plain 1F1B) and Megatron-core's
    two p2p switches (``ModelParallelConfig.batch_p2p_comm`` / ``overlap_p2p_comm``)."""

    name: str
    num_model_chunks: int
    batch_p2p_comm: bool
    overlap_p2p_comm: bool
    label: str


CASES: Dict[str, Case] = {c.name: c for c in [
    Case("1f1b", 1, True, False, "1F1B"),
    Case("interleaved", 2, False, True,
         "interleaved, v=2, batch_p2p_comm=False, overlap_p2p_comm=True"),
    Case("interleaved-batched", 2, True, False,
         "interleaved, v=2, batch_p2p_comm=True (Megatron-core's default)"),
]}

SEQ_LENGTH, MICRO_BATCH = 4, 2
TOY = ToyConfig(num_layers=8, hidden_size=8, vocab_size=16)
TOL = 1e-6   # fp32: the same matmuls in the same order; the twin sums the micro-batches at once


# --------------------------------------------------------------------------- rank side
def _megatron_config(num_layers: int, hidden_size: int, p: int, case: Case):
    """The ``TransformerConfig`` Megatron-core's schedules read (message shape and dtype, the
    p2p switches); nothing else in it is used by the toy model."""
    with mc.without_cuda_runtime_notice():
        # megatron-core is optional (and slow to import): imported only where it is used.
        from megatron.core.transformer import TransformerConfig
    v = case.num_model_chunks
    return TransformerConfig(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=1,
        use_cpu_initialization=True, pipeline_model_parallel_size=p,
        virtual_pipeline_model_parallel_size=v if v > 1 else None,
        pipeline_dtype=torch.float32, batch_p2p_comm=case.batch_p2p_comm,
        overlap_p2p_comm=case.overlap_p2p_comm)


def _stage_chunks(dense: ToyModel, p: int, v: int) -> List[torch.nn.Module]:
    """This rank's chunks with the twin's weights; the last stage's copy of the tied embedding
    filled from the twin (what ``sync_embedding_weights`` does at start)."""
    chunks = build_toy_model_chunks(dense, ps.get_pipeline_model_parallel_rank(), p,
                                    v if v > 1 else None)
    with torch.no_grad():
        for chunk in chunks:
            if chunk.post_process:
                chunk.word_embeddings.copy_(dense.word_embeddings)
    return chunks


def _gradients(chunks, dense: Optional[ToyModel] = None) -> Dict[str, torch.Tensor]:
    """``{name: gradient}`` of this rank's stage parameters, or of the same parameters of the
    twin ``dense`` (the layers by their number, the embedding by its name)."""
    out = {}
    for k, chunk in enumerate(chunks):
        for n, layer in zip(chunk.layer_numbers, chunk.layers):
            src = dense.layers[n] if dense is not None else layer
            out[f"layers.{n}.weight"] = src.weight.grad
            out[f"layers.{n}.bias"] = src.bias.grad
        if chunk.word_embeddings is not None:
            src = dense if dense is not None else chunk
            out[f"word_embeddings (chunk {k})"] = src.word_embeddings.grad
    return out


def _max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _run_megatron(chunks, batches, case: Case, p: int, num_microbatches: int) -> None:
    with mc.without_cuda_runtime_notice():
        # megatron-core is optional (and slow to import): imported only where it is used.
        from megatron.core import parallel_state as mps
        from megatron.core.enums import ModelType
        from megatron.core.pipeline_parallel import get_forward_backward_func
    v = case.num_model_chunks
    config = _megatron_config(TOY.num_layers, TOY.hidden_size, p, case)
    for chunk in chunks:          # what Megatron-core reads off a model chunk
        chunk.config, chunk.model_type = config, ModelType.encoder_or_decoder
    mps.set_virtual_pipeline_model_parallel_world_size(v if v > 1 else None)
    iterators = [iter(batches) for _ in chunks]
    try:
        get_forward_backward_func()(
            forward_step_func=toy_forward_step,
            data_iterator=iterators if v > 1 else iterators[0],
            model=chunks if v > 1 else chunks[0], num_microbatches=num_microbatches,
            seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH, forward_only=False)
    finally:
        mps.set_virtual_pipeline_model_parallel_world_size(None)
        for chunk in chunks:
            chunk.config = TOY


def _run_mpu_lab(chunks, batches, case: Case, num_microbatches: int) -> None:
    iterators = [iter(batches) for _ in chunks]
    if case.num_model_chunks > 1:
        run, model, data = schedules.forward_backward_pipelining_with_interleaving, chunks, iterators
    else:
        run, model, data = (schedules.forward_backward_pipelining_without_interleaving,
                            chunks[0], iterators[0])
    run(forward_step_func=toy_forward_step, data_iterator=data, model=model,
        num_microbatches=num_microbatches, seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH)


def compare_case(case: Case, num_microbatches: int = 4, seed: int = 1234) -> Dict[str, object]:
    """Runs inside every rank of a world of ``p`` ranks with the default group made (mpu_lab's
    ``initialize.init``): one iteration of ``case`` through both libraries and the twin.
    Returns this rank's ``{case, stage, megatron_vs_mpu_lab, megatron_vs_twin,
    mpu_lab_vs_twin}`` (largest absolute gradient differences)."""
    p = torch.distributed.get_world_size()
    v = case.num_model_chunks
    ps.initialize_model_parallel(pipeline_model_parallel_size=p,
                                 virtual_pipeline_model_parallel_size=v if v > 1 else None)
    try:
        mc.initialize()
        dense = ToyModel(TOY, seed=seed)
        batches = toy_batches(TOY, num_microbatches, SEQ_LENGTH, MICRO_BATCH, seed=seed)
        grads = {}
        for library in ("megatron_core", "mpu_lab"):
            chunks = _stage_chunks(dense, p, v)
            if library == "megatron_core":
                with megatron_core_cpu.cpu_patches(on_cpu=initialize.get_device().type == "cpu"):
                    _run_megatron(chunks, batches, case, p, num_microbatches)
            else:
                _run_mpu_lab(chunks, batches, case, num_microbatches)
            allreduce_embedding_grads(chunks)
            grads[library] = _gradients(chunks)
        twin = sum(dense(b["tokens"], b["labels"]) for b in batches) / num_microbatches
        twin.backward()
        grads["twin"] = _gradients(chunks, dense)
        return dict(case=case.name, stage=ps.get_pipeline_model_parallel_rank(),
                    megatron_vs_mpu_lab=_max_diff(grads["megatron_core"], grads["mpu_lab"]),
                    megatron_vs_twin=_max_diff(grads["megatron_core"], grads["twin"]),
                    mpu_lab_vs_twin=_max_diff(grads["mpu_lab"], grads["twin"]))
    finally:
        mc.destroy()
