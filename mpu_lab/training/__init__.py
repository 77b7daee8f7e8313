"""Train the small GPT with tensor, sequence, pipeline and data parallelism
(``launch/train_gpt.py``), split along Megatron's own files: :mod:`~mpu_lab.training.arguments`
(``megatron/training/arguments.py``: flags, pure checks, the script's pre-check),
:mod:`~mpu_lab.training.initialize` (``megatron/training/initialize.py``: the process group,
backend and device: ``init``, ``shutdown``, ``get_device``),
:mod:`~mpu_lab.training.optimizer_param_scheduler` (the learning-rate schedule),
:mod:`~mpu_lab.training.setup` (``get_model``, ``setup``, ``get_batch``),
:mod:`~mpu_lab.training.training` (``megatron/training/training.py``: ``train_step``,
``train``, ``pretrain``), :mod:`~mpu_lab.training.checkpointing` (DCP save, load and
resharding), :mod:`~mpu_lab.training.datasets` and the single-process twin
(:mod:`~mpu_lab.training.plain_gpt`, :mod:`~mpu_lab.training.dense_twin`). The gradient
reductions are the mirror's (``core/distributed/finalize_model_grads.py``); AdamW, clipping
and the fp16 loss scale are in ``mpu_lab/core/optimizer/``. Lab 17's injected
faults (``--inject-fault``) live beside the loop (:mod:`mpu_lab.training.faults`) and enter as
callbacks of the loop (:class:`~mpu_lab.training.training.Callback`) and a checkpoint writer:
the loop has no fault branch.

Data parallelism at PP=1 is torch's ``DistributedDataParallel`` on the data-parallel group,
with a communication hook that routes its bucket all-reduces through ``mpu_lab.core.comm``, the
one place collectives are called. At PP > 1 DDP is not used: it all-reduces
during the backward of the micro-batch it runs last, and a pipeline schedule runs many
backwards (of several chunks) between p2p messages, so the gradients are averaged over the
data-parallel group explicitly, once per step after the schedule — what Megatron's own DDP
does in ``finish_grad_sync``. Mixed precision is ``torch.autocast`` over fp32 parameters (the
optimizer always sees fp32), with a dynamic loss scale for ``--fp16`` whose overflow check is
agreed on by the whole model-parallel group, as in Megatron.

This package re-exports the public names of its modules that the launch scripts, labs and
tests use.
"""
from mpu_lab.training.arguments import (
    build_parser, check_launch_args, model_config, parse_args, validate_args,
    vocab_padding_message)
from mpu_lab.training.dense_twin import train_dense_twin
from mpu_lab.training.optimizer_param_scheduler import OptimizerParamScheduler, build_scheduler
from mpu_lab.training.setup import TrainState, get_batch, get_model, setup
from mpu_lab.training.training import (
    Callback, average_losses_across_data_parallel_group, dense_twin_losses, dense_twin_weights, forward_step,
    loss_across_context_parallel_ranks, masked_mean_loss, pretrain, train, train_step,
    train_step_pipelined)

__all__ = [
    "build_parser", "parse_args", "validate_args", "check_launch_args", "model_config",
    "vocab_padding_message", "OptimizerParamScheduler", "build_scheduler", "TrainState",
    "get_model", "setup", "get_batch", "Callback", "train_step", "train_step_pipelined", "forward_step",
    "masked_mean_loss", "loss_across_context_parallel_ranks", "train", "pretrain",
    "train_dense_twin", "dense_twin_weights", "dense_twin_losses",
    "average_losses_across_data_parallel_group",
]
