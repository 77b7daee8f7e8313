"""The dense twin's training: a single-process model (e.g. :class:`~mpu_lab.training.plain_gpt.PlainGPT`
holding the gathered TP=1 weights) trained with the same data, batches, optimizer, schedule and
clipping as :func:`mpu_lab.training.train` at DP=1, to compare the parallel run with. The lab's
own check; Megatron has no counterpart."""
from __future__ import annotations

import argparse
from typing import List, Optional

import torch

from mpu_lab.training import datasets
from mpu_lab.core.optimizer import build_optimizer
from mpu_lab.training.optimizer_param_scheduler import build_scheduler


def train_dense_twin(args: argparse.Namespace, model: torch.nn.Module, iterations: int,
                     start_iteration: int = 0, grad_norms: Optional[List[float]] = None) -> List[float]:
    """Train a single-process model (e.g. :class:`~mpu_lab.training.plain_gpt.PlainGPT` holding the
    gathered TP=1 weights) with the same data, batches, optimizer, schedule and clipping as
    :func:`train` at DP=1 (``num_micro_batches x DP`` micro-batches per step). Returns the
    per-iteration losses; appends each step's gradient norm (before clipping) to
    ``grad_norms`` when given. No ``torch.distributed`` needed."""
    M = args.num_micro_batches * args.data_parallel_size
    dataset = datasets.build_dataset(args.data_path, args.global_batch_size * args.train_iters,
                                     args.seq_length, args.vocab_size, args.seed)
    optimizer = build_optimizer(model, args)
    scheduler = build_scheduler(optimizer, args)
    scheduler.num_steps = start_iteration
    losses = []
    for it in range(start_iteration, start_iteration + iterations):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(M):
            ids = datasets.batch_indices(it, m, args.micro_batch_size, 0, 1, M)
            batch = datasets.collate([dataset[i] for i in ids])
            per_token = model(batch["tokens"], labels=batch["labels"])
            loss = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
            (loss / M).backward()
            total += float(loss)
        scheduler.lr_for_next_step()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad or float("inf"))
        if grad_norms is not None:
            grad_norms.append(float(norm))
        optimizer.step()
        scheduler.step()
        losses.append(total / M)
    return losses
