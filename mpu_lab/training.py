"""Train the small GPT with tensor, sequence, pipeline and data parallelism (``launch/train_gpt.py``).

The pieces, in the order a step uses them (Megatron's ``pretrain`` / ``train_step``):

* :func:`parse_args` / :func:`validate_args` — Megatron-style flags; the validation is pure
  (no ``torch.distributed``) so a notebook or launcher can reject a bad configuration *before*
  any process starts, with a ``ValueError`` naming the numbers;
* :func:`setup` — groups, seeds, :func:`get_model` (the :class:`~mpu_lab.models.GPTModel`,
  or this rank's pipeline stage / model chunks), DDP over the data-parallel group (PP=1),
  AdamW, the learning-rate schedule, an optional checkpoint;
* :func:`train_step` — ``num_micro_batches`` forward/backward passes (gradient accumulation:
  global batch = micro batch x micro-batches x DP), sequence-parallel gradient all-reduce,
  fp16 loss-scale check, TP-aware gradient clipping, the optimizer step. With
  ``--pipeline-model-parallel-size`` > 1, :func:`train_step_pipelined`: the micro-batches go
  through the stages under :func:`~mpu_lab.pipeline_parallel.get_forward_backward_func`
  (GPipe, 1F1B or interleaved, ``--pipeline-schedule``) with :func:`forward_step`, then the
  data-parallel, sequence-parallel and tied-embedding gradient reductions;
* :func:`train` — the loop, logging JSON lines (``--metrics-file``) and saving checkpoints.

Data parallelism at PP=1 is torch's ``DistributedDataParallel`` on the data-parallel group
(``process_group=get_data_parallel_group()``), with a communication hook that routes its
bucket all-reduces through :mod:`mpu_lab.comm` so they are counted (tag
``grads.data_parallel``). At PP > 1 DDP is not used: it all-reduces during the backward of
the micro-batch it runs last, and a pipeline schedule runs many backwards (of several
chunks) between p2p messages, so the gradients are averaged over the data-parallel group
explicitly, once per step after the schedule (:func:`allreduce_data_parallel_grads`, same
tag) — what Megatron's own DDP does in ``finish_grad_sync``. Mixed precision is ``torch.autocast`` over fp32 parameters (the
optimizer always sees fp32), with a dynamic loss scale for ``--fp16`` whose overflow check is
agreed on by the whole model-parallel group, as in Megatron.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import socket
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from mpu_lab.datasets import BYTE_VOCAB_SIZE
from mpu_lab.distributed import init_single_process  # noqa: F401  (re-exported)
from mpu_lab.models.gpt import pad_vocab_size
from mpu_lab.models.transformer import TransformerConfig
from mpu_lab.timers import StepTimer
from mpu_lab.utils import divisors


# --------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_gpt.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train a small GPT with tensor/sequence/data parallelism (Megatron-style flags).")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-schedule", default=None, metavar="{gpipe,1f1b,interleaved}",
                   help="pipeline schedule (PP > 1): all-forward-all-backward (GPipe; alias afab), "
                        "1F1B (alias pipedream-flush), or interleaved 1F1B over virtual stages; "
                        "default as Megatron: interleaved when "
                        "--num-layers-per-virtual-pipeline-stage is given, else 1f1b")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per model chunk for the interleaved schedule (Megatron's flag): "
                        "v = num_layers / PP / this")
    g.add_argument("--sequence-parallel", action="store_true")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default: --seq-length")
    g.add_argument("--activation", choices=["gelu", "relu"], default="gelu")
    g.add_argument("--hidden-dropout", type=float, default=0.0,
                   help="Megatron's default is 0.1; 0 keeps runs at different TP sizes equal")
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP size (Megatron)")
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true",
                   help="synthetic learnable data (the default when --data-path is not given)")
    g.add_argument("--data-path", default=None, help="a text file, read as bytes (vocab 256)")
    g.add_argument("--vocab-size", type=int, default=512, help="vocabulary of the mock data")
    g = p.add_argument_group("batch and schedule")
    g.add_argument("--micro-batch-size", type=int, default=8)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro batch size x data-parallel size")
    g.add_argument("--train-iters", type=int, default=300)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("precision")
    g.add_argument("--fp16", action="store_true", help="autocast to float16, dynamic loss scale")
    g.add_argument("--bf16", action="store_true", help="autocast to bfloat16")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16)
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--metrics-file", default=None,
                   help="append one JSON line per logged iteration (rank 0)")
    g.add_argument("--quiet", action="store_true", help="no per-iteration log lines")
    g.add_argument("--record-timeline", action="store_true",
                   help="PP > 1: every rank reports the forward/backward start and end times of "
                        "its last iteration (launch.report), for a Gantt chart of the real run")
    g.add_argument("--breakdown", action="store_true",
                   help="every rank times its steps and the collectives in them and reports "
                        "the per-step breakdown (compute vs each kind of collective; "
                        "mpu_lab.perf.measure) under \"breakdown\"; the first step is not timed")
    g.add_argument("--breakdown-barrier", action="store_true",
                   help="--breakdown with a barrier before each collective, booked as "
                        "'wait': separates waiting for peers from the transfer itself")
    g.add_argument("--breakdown-profile", default=None, metavar="DIR",
                   help="--breakdown under torch.profiler: each rank writes a Chrome trace of "
                        "its timed steps to DIR/rank<r>.trace.json and reports its top ops")
    g.add_argument("--save", default=None, help="folder for iter_XXXXXXX checkpoints")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None,
                   help="a checkpoint folder, or a folder of iter_XXXXXXX checkpoints (latest)")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(None if argv is None else list(map(str, argv)))


def check_launch_args(argv: Sequence[str], world_size: int, cwd=None) -> argparse.Namespace:
    """What ``launch.run("train_gpt.py", argv, nproc=world_size)`` checks before torchrun
    starts: parse, :func:`validate_args`, and a ``--load`` checkpoint's files against the sums
    recorded at save (:func:`mpu_lab.checkpointing.verify_checkpoint`). Relative paths are
    taken from ``cwd``, the job's working folder, when given."""
    args = parse_args(argv)
    if cwd is not None:
        for name in ("data_path", "load"):
            value = getattr(args, name)
            if value and not os.path.isabs(value):
                setattr(args, name, os.path.join(str(cwd), value))
    validate_args(args, world_size)
    if args.load:
        from mpu_lab import checkpointing
        checkpointing.verify_checkpoint(args.load)
    return args


def model_config(args) -> TransformerConfig:
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        activation=args.activation, sequence_parallel=args.sequence_parallel,
        layernorm_epsilon=args.layernorm_epsilon, init_method_std=args.init_method_std)


def validate_args(args: argparse.Namespace, world_size: int, check_load: bool = True
                  ) -> argparse.Namespace:
    """Check ``args`` for a job of ``world_size`` ranks and fill in the derived values
    (``data_parallel_size``, ``num_micro_batches``, ``padded_vocab_size``, ...).

    Pure: no ``torch.distributed``, so it runs in the notebook before ``torchrun`` starts.
    Raises ``ValueError`` naming the numbers and what would be valid. Returns ``args``.
    """
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if tp < 1 or pp < 1:
        raise ValueError(f"--tensor-model-parallel-size {tp} and --pipeline-model-parallel-size "
                         f"{pp} must be >= 1")
    if world_size % (tp * pp):
        if pp == 1:
            valid = f"with {world_size} ranks valid tensor-parallel sizes are {divisors(world_size)}"
        elif world_size % pp == 0:
            valid = (f"with {world_size} ranks and {pp} pipeline stages valid tensor-parallel "
                     f"sizes are {divisors(world_size // pp)}")
        else:
            valid = (f"{pp} pipeline stages do not divide {world_size} ranks: valid "
                     f"pipeline-parallel sizes are {divisors(world_size)}")
        raise ValueError(
            f"world size {world_size} is not divisible by tensor x pipeline parallel size "
            f"{tp} x {pp} = {tp * pp}; {valid}")
    dp = world_size // (tp * pp)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters", "log_interval"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    model_config(args).check(tp, args.seq_length)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.max_position_embeddings < args.seq_length:
        raise ValueError(f"--max-position-embeddings {args.max_position_embeddings} is smaller "
                         f"than --seq-length {args.seq_length}: the position table needs a row "
                         f"per position; use >= {args.seq_length} (or leave it out: default "
                         f"--seq-length)")

    mbs = args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    gbs = args.global_batch_size
    if gbs < 1 or gbs % (mbs * dp):
        raise ValueError(
            f"--global-batch-size {gbs} must be a multiple of micro batch size x data-parallel "
            f"size = {mbs} x {dp} = {mbs * dp} (global batch = micro batch x micro-batches x "
            f"DP); e.g. {mbs * dp}, {2 * mbs * dp} or {4 * mbs * dp}")
    args.data_parallel_size = dp
    args.num_micro_batches = gbs // (mbs * dp)
    args.world_size = world_size
    _validate_pipeline(args)

    if args.fp16 and args.bf16:
        raise ValueError("--fp16 and --bf16 exclude each other: pick one")
    if args.lr <= 0 or args.min_lr < 0 or args.min_lr > args.lr:
        raise ValueError(f"need 0 <= --min-lr ({args.min_lr}) <= --lr ({args.lr}) and --lr > 0")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_decay_iters < 1:
        raise ValueError(f"--lr-decay-iters must be >= 1, got {args.lr_decay_iters}")
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters:
            raise ValueError(f"give --lr-warmup-fraction ({args.lr_warmup_fraction}) or "
                             f"--lr-warmup-iters ({args.lr_warmup_iters}), not both")
        if not 0.0 <= args.lr_warmup_fraction <= 1.0:
            raise ValueError(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
        args.lr_warmup_steps = int(args.lr_warmup_fraction * args.lr_decay_iters)
    else:
        args.lr_warmup_steps = args.lr_warmup_iters
    if not 0 <= args.lr_warmup_steps <= args.lr_decay_iters:
        raise ValueError(f"the warmup ({args.lr_warmup_steps} iterations) must be in "
                         f"[0, --lr-decay-iters {args.lr_decay_iters}]")
    if args.clip_grad < 0 or args.weight_decay < 0:
        raise ValueError(f"--clip-grad ({args.clip_grad}) and --weight-decay "
                         f"({args.weight_decay}) must be >= 0")
    if args.save_interval is not None and (args.save_interval < 1 or not args.save):
        raise ValueError(f"--save-interval {args.save_interval} needs --save DIR and a value >= 1")

    if args.data_path:
        from mpu_lab.datasets import check_text_file
        check_text_file(args.data_path, args.seq_length)
        args.vocab_size = BYTE_VOCAB_SIZE
    if args.vocab_size < 2:
        raise ValueError(f"--vocab-size must be >= 2, got {args.vocab_size} (the mock data "
                         f"needs at least 2 tokens; {BYTE_VOCAB_SIZE} with --data-path)")
    if args.make_vocab_size_divisible_by < 1:
        raise ValueError(f"--make-vocab-size-divisible-by must be >= 1, got "
                         f"{args.make_vocab_size_divisible_by}: the vocabulary is padded to a "
                         f"multiple of it x TP ({tp}); use 1 for no padding, or Megatron's 128")
    args.padded_vocab_size = pad_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, tp)

    if check_load and args.load:
        from mpu_lab import checkpointing
        # complete and compatible; the files' sums are checked once by check_launch_args
        # (before torchrun starts) and where they are read (checkpointing.load_checkpoint)
        path = checkpointing.find_checkpoint(args.load)
        checkpointing.check_compatible(checkpointing.read_checkpoint_info(path), args)
    return args


def _validate_pipeline(args) -> None:
    """The pipeline checks (:func:`mpu_lab.pipeline_parallel.validate_pipeline_args`) in terms
    of this script's flags; fills in ``pipeline_schedule`` and
    ``virtual_pipeline_model_parallel_size``."""
    from mpu_lab.pipeline_parallel import validate_pipeline_args
    pp, nlv = args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
    if pp == 1:
        given = [f for f, v in (("--pipeline-schedule", args.pipeline_schedule),
                                ("--num-layers-per-virtual-pipeline-stage", nlv)) if v is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} {'need' if len(given) > 1 else 'needs'} "
                             f"--pipeline-model-parallel-size > 1, "
                             f"got 1 (one stage runs its micro-batches one after the other)")
        args.virtual_pipeline_model_parallel_size = None
        return
    try:
        pipe = validate_pipeline_args(
            num_layers=args.num_layers, pipeline_model_parallel_size=pp,
            global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
            data_parallel_size=args.data_parallel_size, schedule=args.pipeline_schedule,
            num_layers_per_virtual_pipeline_stage=nlv)
    except ValueError as exc:
        raise ValueError(
            f"{exc} [here: --num-layers {args.num_layers}, --pipeline-model-parallel-size {pp}, "
            f"--num-layers-per-virtual-pipeline-stage {nlv}, --pipeline-schedule "
            f"{args.pipeline_schedule}, micro-batches per step = --global-batch-size "
            f"{args.global_batch_size} / (--micro-batch-size {args.micro_batch_size} x DP "
            f"{args.data_parallel_size}) = {args.num_micro_batches}]") from None
    args.pipeline_schedule = pipe["schedule"]
    args.virtual_pipeline_model_parallel_size = pipe["virtual_pipeline_model_parallel_size"]


def vocab_padding_message(args) -> str:
    return (f"> padded vocab (size: {args.vocab_size}) with "
            f"{args.padded_vocab_size - args.vocab_size} dummy tokens (new size: "
            f"{args.padded_vocab_size}): a multiple of make_vocab_size_divisible_by x TP = "
            f"{args.make_vocab_size_divisible_by} x {args.tensor_model_parallel_size}, as Megatron does")


# --------------------------------------------------------------------------- learning rate
class OptimizerParamScheduler:
    """Megatron's learning-rate schedule, counted in iterations: linear warmup from 0 to
    ``max_lr`` over ``warmup_steps``, then ``constant`` / ``linear`` / ``cosine`` decay to
    ``min_lr`` at ``decay_steps``, ``min_lr`` after. Step ``k`` (1-based) uses
    ``get_lr(k - 1)``, as Megatron (which starts counting at 0)."""

    def __init__(self, optimizer, max_lr: float, min_lr: float, warmup_steps: int,
                 decay_steps: int, decay_style: str):
        if decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"decay_style must be constant, linear or cosine, got {decay_style!r}")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style = decay_style
        self.num_steps = 0
        self._apply(self.get_lr(0))

    def get_lr(self, num_steps: int) -> float:
        if self.warmup_steps > 0 and num_steps <= self.warmup_steps:
            return self.max_lr * num_steps / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if num_steps > self.decay_steps:
            return self.min_lr
        ratio = (num_steps - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _apply(self, lr: float):
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def lr_for_next_step(self) -> float:
        lr = self.get_lr(self.num_steps)
        self._apply(lr)
        return lr

    def step(self):
        self.num_steps += 1

    def state_dict(self) -> Dict[str, Any]:
        return dict(num_steps=self.num_steps, max_lr=self.max_lr, min_lr=self.min_lr,
                    warmup_steps=self.warmup_steps, decay_steps=self.decay_steps,
                    decay_style=self.decay_style)

    def load_state_dict(self, state: Dict[str, Any]):
        # The step count comes from the checkpoint; the schedule's shape from this run's flags.
        self.num_steps = int(state["num_steps"])


# --------------------------------------------------------------------------- helpers
def build_optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and LayerNorm parameters (1-D), as Megatron."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.dim() == 1 else decay).append(p)
    groups = [dict(params=decay, weight_decay=args.weight_decay),
              dict(params=no_decay, weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_eps)


def build_scheduler(optimizer, args) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(optimizer, args.lr, args.min_lr, args.lr_warmup_steps,
                                   args.lr_decay_iters,
                                   "constant" if args.lr_decay_style == "constant" else args.lr_decay_style)


def clip_grad_norm(parameters, max_norm: float, model_parallel_group=None) -> float:
    """Global L2 norm of the gradients of a tensor-parallel model, then clip to ``max_norm``.

    A split parameter contributes its shard on every rank; a replicated one (LayerNorm,
    position embedding, row-parallel bias) only on tensor-parallel rank 0, and the last
    pipeline stage's copy of the tied embedding (marked ``shared``) not at all — its gradient
    is the first stage's — so nothing is counted twice; the squares are summed over the
    model-parallel group, tensor x pipeline (Megatron's ``get_grad_norm_fp32``).
    ``max_norm = 0`` only measures. Every parameter is clipped.
    """
    from mpu_lab import comm
    from mpu_lab.tensor_parallel import param_is_not_tensor_parallel_duplicate
    params = [p for p in parameters if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False):
            total += p.grad.detach().float().pow(2).sum()
    if model_parallel_group is not None and comm.group_size(model_parallel_group) > 1:
        with comm.comm_tag("grads.norm"):
            total = comm.all_reduce(total, group=model_parallel_group)
    norm = float(total.sqrt())
    if max_norm > 0:
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            for p in params:
                p.grad.detach().mul_(coeff)
    return norm


class DynamicLossScaler:
    """fp16 loss scaling (Megatron's ``DynamicGradScaler``): halve the scale and skip the step
    on an overflow seen by *any* rank of the model-parallel group; double it after
    ``growth_interval`` clean steps."""

    def __init__(self, initial_scale: float = 2.0 ** 16, min_scale: float = 1.0,
                 growth_interval: int = 1000):
        self.scale, self.min_scale, self.growth_interval = initial_scale, min_scale, growth_interval
        self.clean_steps = 0

    def unscale_and_check(self, params, group) -> bool:
        from mpu_lab import comm
        grads = [p.grad for p in params if p.grad is not None]
        found = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
        for g in grads:
            g.mul_(1.0 / self.scale)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        if group is not None and comm.group_size(group) > 1:
            import torch.distributed as dist
            with comm.comm_tag("grads.overflow"):
                found = comm.all_reduce(found, group=group, op=dist.ReduceOp.MAX)
        return bool(found.item() > 0)

    def update(self, found_inf: bool):
        if found_inf:
            self.scale = max(self.min_scale, self.scale / 2)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= 2


def _ddp_counted_allreduce_hook(state, bucket):
    """DDP communication hook: average the bucket over the data-parallel group through
    :mod:`mpu_lab.comm` (counted, tag ``grads.data_parallel``) instead of DDP's own call."""
    from mpu_lab import comm
    group, size = state
    with comm.comm_tag("grads.data_parallel"):
        reduced = comm.all_reduce(bucket.buffer(), group=group)
    reduced.div_(size)
    fut = torch.futures.Future()
    fut.set_result(reduced)
    return fut


# --------------------------------------------------------------------------- training
@dataclasses.dataclass
class TrainState:
    args: argparse.Namespace
    model: torch.nn.Module            # the GPTModel (PP > 1: this rank's stage; a ModuleList of
                                      # its chunks with virtual stages)
    ddp_model: torch.nn.Module        # what forward goes through (DDP, or the model at DP=1)
    optimizer: torch.optim.Optimizer
    scheduler: OptimizerParamScheduler
    dataset: Any
    iteration: int = 0               # optimizer steps done
    scaler: Optional[DynamicLossScaler] = None
    skipped_iterations: int = 0
    model_chunks: List[torch.nn.Module] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.model_chunks:
            self.model_chunks = model_chunks_of(self.model)


def model_chunks_of(model) -> List[torch.nn.Module]:
    """``[model]``, or the chunks of a list / ``ModuleList`` of pipeline model chunks."""
    if isinstance(model, (list, tuple, torch.nn.ModuleList)):
        return list(model)
    return [model]


def get_model(args: argparse.Namespace) -> torch.nn.Module:
    """This rank's part of the GPT (Megatron's ``get_model``): the whole
    :class:`~mpu_lab.models.GPTModel` at PP=1; at PP > 1 its pipeline stage, or a
    ``ModuleList`` of its ``v`` chunks with virtual stages, holding the same weights as the
    PP=1 model (:func:`~mpu_lab.models.build_model_chunks`), the tied embedding copies made
    equal over the embedding group. Groups and seeds must be set."""
    from mpu_lab.models.gpt import build_model_chunks
    from mpu_lab.pipeline_parallel import sync_embedding_weights
    chunks = build_model_chunks(model_config(args), args.padded_vocab_size,
                                args.max_position_embeddings)
    if args.pipeline_model_parallel_size > 1:
        sync_embedding_weights(chunks)
    return chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)


def setup(args: argparse.Namespace, log: Callable[[str], None] = print) -> TrainState:
    """Groups, seeds, model, DDP, optimizer, schedule, data; loads ``args.load`` if given.
    ``args`` must have been through :func:`validate_args`. ``torch.distributed`` must be up."""
    import torch.distributed as dist

    from mpu_lab import datasets, distributed, parallel_state
    from mpu_lab.tensor_parallel import model_parallel_manual_seed

    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None))
    model_parallel_manual_seed(args.seed)
    device = distributed.get_device()
    model = get_model(args)
    ddp_model = model
    dp = parallel_state.get_data_parallel_world_size()
    # Data parallelism: torch DDP at PP=1. At PP > 1 the schedule interleaves the backwards of
    # many micro-batches (and chunks) with p2p messages; DDP would all-reduce during the last
    # micro-batch's backward, which under 1F1B is not the last backward to run. So there the
    # gradients are all-reduced explicitly over the data-parallel group once per step, after
    # the schedule (allreduce_data_parallel_grads), as Megatron's own DDP does in
    # finish_grad_sync.
    if dp > 1 and args.pipeline_model_parallel_size == 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        group = parallel_state.get_data_parallel_group()
        ddp_model = DDP(model, device_ids=[device] if device.type == "cuda" else None,
                        process_group=group)   # GPTModel has no buffers to sync
        ddp_model.register_comm_hook((group, dp), _ddp_counted_allreduce_hook)
    optimizer = build_optimizer(model, args)
    scheduler = build_scheduler(optimizer, args)
    num_samples = args.global_batch_size * max(args.train_iters, 1)
    dataset = datasets.build_dataset(args.data_path, num_samples, args.seq_length,
                                     args.vocab_size, args.seed)
    state = TrainState(args, model, ddp_model, optimizer, scheduler, dataset,
                       scaler=DynamicLossScaler(args.initial_loss_scale) if args.fp16 else None)
    if dist.get_rank() == 0 and args.padded_vocab_size != args.vocab_size:
        log(vocab_padding_message(args))
    if args.load:
        from mpu_lab import checkpointing
        info = checkpointing.load_checkpoint(
            args.load, model, optimizer=None if args.no_load_optim else optimizer,
            scheduler=None if args.no_load_optim else scheduler, load_rng=not args.no_load_rng,
            args=args)
        state.iteration = info["iteration"]
        if dist.get_rank() == 0:
            log(f"> loaded {info['path']} (iteration {info['iteration']}, saved at TP="
                f"{info['tensor_model_parallel_size']} PP={info.get('pipeline_model_parallel_size', 1)}"
                f", now TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size})")
    return state


def get_batch(state: TrainState, iteration: int, micro_batch: int) -> Dict[str, torch.Tensor]:
    """This rank's micro-batch: read by tensor-parallel rank 0, broadcast to its group
    (Megatron's ``broadcast_data``: the group works on the same tokens)."""
    from mpu_lab import comm, datasets, distributed, parallel_state
    from mpu_lab.tensor_parallel import broadcast_data
    args = state.args
    keys = ["tokens", "labels", "position_ids", "loss_mask"]
    data = None
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        ids = datasets.batch_indices(iteration, micro_batch, args.micro_batch_size,
                                     parallel_state.get_data_parallel_rank(),
                                     parallel_state.get_data_parallel_world_size(),
                                     args.num_micro_batches)
        batch = datasets.collate([state.dataset[i] for i in ids])
        batch["loss_mask"] = batch["loss_mask"].long()
        data = batch
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        with comm.comm_tag("data"):
            out = broadcast_data(keys, data, torch.int64)
    else:
        device = distributed.get_device()
        out = {k: data[k].to(device) for k in keys}
    out["loss_mask"] = out["loss_mask"].float()
    return out


def _autocast(args, device):
    if args.bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if args.fp16:
        return torch.autocast(device_type=device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def _optimizer_step(args, state, params):
    """Unscale (fp16), clip over the model-parallel group, step, advance the schedule.

    Returns ``(lr, grad_norm, skipped)``; ``grad_norm`` is NaN when fp16 overflow skipped
    the step.
    """
    from mpu_lab import parallel_state
    mp_group = parallel_state.get_model_parallel_group()
    skipped = False
    if state.scaler:
        skipped = state.scaler.unscale_and_check(params, mp_group)
        state.scaler.update(skipped)
    lr = state.scheduler.lr_for_next_step()
    grad_norm = float("nan")
    if not skipped:
        grad_norm = clip_grad_norm(params, args.clip_grad, mp_group)
        state.optimizer.step()
    else:
        state.skipped_iterations += 1
    state.scheduler.step()
    state.iteration += 1
    return lr, grad_norm, skipped


def train_step(state: TrainState) -> Dict[str, float]:
    """One iteration (``state.iteration`` is 0-based on entry, incremented on exit)."""
    if state.args.pipeline_model_parallel_size > 1:
        return train_step_pipelined(state)
    from mpu_lab import comm, distributed, parallel_state
    from mpu_lab.models.transformer import finalize_model_grads
    args, model, ddp_model = state.args, state.model, state.ddp_model
    device = distributed.get_device()
    model.train()
    state.optimizer.zero_grad(set_to_none=True)
    M = args.num_micro_batches
    scale = state.scaler.scale if state.scaler else 1.0
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    for m in range(M):
        batch = get_batch(state, state.iteration, m)
        sync = contextlib.nullcontext()
        if ddp_model is not model and m < M - 1:
            sync = ddp_model.no_sync()   # accumulate locally; all-reduce on the last micro-batch
        with sync:
            with _autocast(args, device):
                losses = ddp_model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
            mask = batch["loss_mask"]
            loss = (losses.float() * mask).sum() / mask.sum()        # mean over this micro-batch
            (loss * (scale / M)).backward()
        comm.clear_backward_tag()
        loss_sum += loss.detach()
    finalize_model_grads(model)
    params = [p for p in model.parameters() if p.requires_grad]
    lr, grad_norm, skipped = _optimizer_step(args, state, params)
    # Loss of the global batch: mean over micro-batches, then over the data-parallel group.
    loss = loss_sum / M
    dp_group = parallel_state.get_data_parallel_group()
    if comm.group_size(dp_group) > 1:
        with comm.comm_tag("logging"):
            loss = comm.all_reduce(loss, group=dp_group) / comm.group_size(dp_group)
    out = dict(lm_loss=float(loss), grad_norm=grad_norm, lr=lr, skipped=skipped)
    if state.scaler:
        out["loss_scale"] = state.scaler.scale
    return out


def _microbatches(state: TrainState, iteration: int, chunk) -> Iterator[Optional[Dict[str, torch.Tensor]]]:
    """One chunk's data iterator for one iteration: a micro-batch for each forward. Only the
    chunks with the embedding (tokens) or the loss (labels, mask) read data; the others get
    ``None`` (Megatron's ``get_batch`` on middle stages)."""
    needs_data = chunk.pre_process or chunk.post_process
    for m in range(state.args.num_micro_batches):
        yield get_batch(state, iteration, m) if needs_data else None


def forward_step(state: TrainState, data_iterator, model):
    """Megatron's ``forward_step_func`` for the pipeline schedules: one micro-batch through
    one model chunk; returns ``(output_tensor, loss_func)``. The first stage feeds tokens, the
    last one labels; ``loss_func`` turns the per-token loss into this micro-batch's mean over
    ``loss_mask`` (the schedule divides by the number of micro-batches)."""
    from mpu_lab import distributed
    from mpu_lab.pipeline_parallel.schedules import unwrap_model
    batch = next(data_iterator)
    chunk = unwrap_model(model)
    labels = batch["labels"] if chunk.post_process else None
    with _autocast(state.args, distributed.get_device()):
        if chunk.pre_process:
            output = model(batch["tokens"], batch["position_ids"], labels=labels)
        else:
            output = model(labels=labels)   # input from set_input_tensor

    def loss_func(per_token_loss):
        mask = batch["loss_mask"]
        loss = (per_token_loss.float() * mask).sum() / mask.sum()
        return loss, {"lm_loss": loss.detach()}

    return output, loss_func


def allreduce_data_parallel_grads(params: Sequence[torch.nn.Parameter]) -> None:
    """Average the gradients over the data-parallel group in one coalesced all-reduce (counted,
    tag ``grads.data_parallel``): what DDP does at PP=1, done once after the pipeline schedule."""
    from mpu_lab import comm, parallel_state
    group = parallel_state.get_data_parallel_group()
    size = comm.group_size(group)
    if size == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    with comm.comm_tag("grads.data_parallel"):
        flat = comm.all_reduce(flat, group=group)
    flat.div_(size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def train_step_pipelined(state: TrainState) -> Dict[str, float]:
    """One iteration with pipeline parallelism (Megatron's ``train_step`` with
    ``get_forward_backward_func()``): the schedule runs the forwards and backwards of all
    micro-batches over the stages; then the gradients are finished — data-parallel average,
    sequence-parallel LayerNorm sums, the tied embedding summed over the first and last stage
    — clipped over the model-parallel group and applied. The loss lives on the last stage; it
    is broadcast over the pipeline so every rank returns it."""
    from mpu_lab import comm, distributed, parallel_state
    from mpu_lab.models.transformer import finalize_model_grads
    from mpu_lab.pipeline_parallel import (
        allreduce_embedding_grads,
        average_losses_across_microbatches,
        get_forward_backward_func,
    )
    args, chunks = state.args, state.model_chunks
    device = distributed.get_device()
    for chunk in chunks:
        chunk.train()
    state.optimizer.zero_grad(set_to_none=True)
    scale = state.scaler.scale if state.scaler else 1.0
    iterators = [_microbatches(state, state.iteration, chunk) for chunk in chunks]
    forward_backward = get_forward_backward_func(args.pipeline_schedule)
    store = forward_backward(
        forward_step_func=functools.partial(forward_step, state),
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=args.num_micro_batches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False,
        grad_scale_func=(lambda loss: loss * scale) if state.scaler else None)
    comm.clear_backward_tag()
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    allreduce_data_parallel_grads(params)
    finalize_model_grads(chunks)
    with comm.comm_tag("grads.embedding"):
        allreduce_embedding_grads(chunks)
    lr, grad_norm, skipped = _optimizer_step(args, state, params)
    # The loss of the global batch: on the last stage the mean over micro-batches, averaged
    # over the data-parallel group; then sent from the last stage to the whole pipeline.
    loss = torch.zeros((), dtype=torch.float32, device=device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        loss += average_losses_across_microbatches(store)["lm_loss"]
        dp_group = parallel_state.get_data_parallel_group()
        if comm.group_size(dp_group) > 1:
            with comm.comm_tag("logging"):
                loss = comm.all_reduce(loss, group=dp_group) / comm.group_size(dp_group)
    with comm.comm_tag("logging"):
        loss = comm.broadcast(loss, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                              group=parallel_state.get_pipeline_model_parallel_group())
    out = dict(lm_loss=float(loss), grad_norm=grad_norm, lr=lr, skipped=skipped)
    if state.scaler:
        out["loss_scale"] = state.scaler.scale
    return out


def schedule_timeline_report() -> Dict[str, Any]:
    """This rank's pipeline coordinates and the records of its last schedule run
    (:func:`~mpu_lab.pipeline_parallel.get_last_schedule_stats`), JSON-able, for
    ``launch.report``; :func:`~mpu_lab.pipeline_parallel.timeline.pipeline_records` turns the
    ranks' reports into the Gantt chart's input. ``{}`` when no schedule has run."""
    from mpu_lab import parallel_state
    from mpu_lab.pipeline_parallel import get_last_schedule_stats
    stats = get_last_schedule_stats()
    if stats is None:
        return {}
    return dict(pipeline_parallel_rank=parallel_state.get_pipeline_model_parallel_rank(),
                tensor_parallel_rank=parallel_state.get_tensor_model_parallel_rank(),
                data_parallel_rank=parallel_state.get_data_parallel_rank(),
                stats=stats.as_dict())


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(state: TrainState, train_iters: Optional[int] = None,
          log: Callable[[str], None] = print) -> List[Dict[str, Any]]:
    """Run to ``train_iters`` (default ``args.train_iters``) optimizer steps; return the
    metrics of each logged iteration (the same dicts as the ``--metrics-file`` lines)."""
    import torch.distributed as dist

    from mpu_lab import checkpointing, distributed
    args = state.args
    end = args.train_iters if train_iters is None else train_iters
    device = distributed.get_device()
    rank0 = dist.get_rank() == 0
    metrics_out = open(args.metrics_file, "a") if (args.metrics_file and rank0) else None
    tokens_per_iteration = args.global_batch_size * args.seq_length
    logged: List[Dict[str, Any]] = []
    window_losses, window_start = [], None
    timer = None
    if getattr(args, "breakdown", False) or getattr(args, "breakdown_barrier", False) \
            or getattr(args, "breakdown_profile", None):
        # train_gpt.py --breakdown: time each step and its collectives (mpu_lab.perf.measure)
        timer = state.step_timer = StepTimer(device, barrier=args.breakdown_barrier,
                                             profile_dir=args.breakdown_profile)
    try:
        _sync(device)
        window_start = time.perf_counter()
        while state.iteration < end:
            step = timer.time_step(train_step, state) if timer else train_step(state)
            window_losses.append(step["lm_loss"])
            it = state.iteration
            if it % args.log_interval == 0 or it == end:
                _sync(device)
                now = time.perf_counter()
                dt = (now - window_start) / len(window_losses)
                record = dict(iteration=it, lm_loss=sum(window_losses) / len(window_losses),
                              grad_norm=step["grad_norm"], lr=step["lr"], iteration_time_s=dt,
                              tokens_per_s=tokens_per_iteration / dt,
                              consumed_samples=it * args.global_batch_size,
                              skipped_iterations=state.skipped_iterations)
                if "loss_scale" in step:
                    record["loss_scale"] = step["loss_scale"]
                logged.append(record)
                if metrics_out:
                    metrics_out.write(json.dumps(record) + "\n")
                    metrics_out.flush()
                if rank0 and not args.quiet:
                    log(f" iteration {it:8d}/{end:8d} | consumed samples: {record['consumed_samples']:9d}"
                        f" | elapsed time per iteration (ms): {dt * 1e3:8.1f} | learning rate: "
                        f"{step['lr']:.3E} | lm loss: {record['lm_loss']:.6E} | grad norm: "
                        f"{step['grad_norm']:.3f} | tokens/s: {record['tokens_per_s']:.0f}")
                window_losses = []
                window_start = time.perf_counter()
            if args.save and args.save_interval and it % args.save_interval == 0:
                checkpointing.save_checkpoint(args.save, state)
                window_start = time.perf_counter()
        if args.save and not (args.save_interval and state.iteration % args.save_interval == 0):
            checkpointing.save_checkpoint(args.save, state)
    finally:
        if metrics_out:
            metrics_out.close()
    return logged


def pretrain(argv: Optional[Sequence[str]] = None, args: Optional[argparse.Namespace] = None,
             log: Callable[[str], None] = print):
    """Parse, validate, set up and train in a process that ``torch.distributed`` already runs
    in (a torchrun worker; groups are (re)initialised from the flags). Returns
    ``(metrics, state)``."""
    import torch.distributed as dist
    if args is None:
        args = parse_args(argv)
    validate_args(args, dist.get_world_size())
    state = setup(args, log=log)
    return train(state, log=log), state


# --------------------------------------------------------------------------- the dense twin
def train_dense_twin(args: argparse.Namespace, model: torch.nn.Module, iterations: int,
                     start_iteration: int = 0, grad_norms: Optional[List[float]] = None) -> List[float]:
    """Train a single-process model (e.g. :class:`~mpu_lab.models.PlainGPT` holding the
    gathered TP=1 weights) with the same data, batches, optimizer, schedule and clipping as
    :func:`train` at DP=1 (``num_micro_batches x DP`` micro-batches per step). Returns the
    per-iteration losses; appends each step's gradient norm (before clipping) to
    ``grad_norms`` when given. No ``torch.distributed`` needed."""
    from mpu_lab import datasets
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
