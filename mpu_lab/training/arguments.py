"""The flags of ``launch/train_gpt.py`` and their checks (Megatron's
``megatron/training/arguments.py``): :func:`build_parser` / :func:`parse_args` with Megatron's
flag names, :func:`validate_args`, which fills in the derived values (data-parallel size,
micro-batches, padded vocabulary, pipeline schedule) and is pure — no ``torch.distributed`` —
so a notebook or the launcher can reject a bad configuration *before* any process starts, with
a ``ValueError`` in flag names whose suggested values each pass every check;
:func:`check_launch_args`, what the launcher checks before ``torchrun`` starts
(:func:`mpu_lab.launcher.precheck`); :func:`parse_and_validate_args`, what the script itself
calls first (one message on rank 0, exit status 2: :mod:`~mpu_lab.training.flag_errors`); and
:func:`model_config`, the :class:`~mpu_lab.core.transformer.transformer_layer.TransformerConfig`
of the flags. Both the parser and the checks are built from named steps, one per argument
group and one per check family, as Megatron's ``_add_*_args`` functions; the model's flags
are in :mod:`~mpu_lab.training.model_args`, the parallelism flags and their checks (tensor,
pipeline, sequence and context parallelism) in :mod:`~mpu_lab.training.parallel_args`, the
mixture-of-experts flags in :mod:`~mpu_lab.training.moe_args`.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Any, Callable, Optional, Sequence

from mpu_lab.training import checkpointing
from mpu_lab.training.datasets import BYTE_VOCAB_SIZE, check_text_file
from mpu_lab.core.models.gpt.gpt_model import pad_vocab_size
from mpu_lab.core.transformer.transformer_layer import TransformerConfig
from mpu_lab.core.utils import divisors
from mpu_lab.training import flag_errors
from mpu_lab.training.flag_errors import NPROC, FlagError
from mpu_lab.training.model_args import add_network_size_args, check_model_args
from mpu_lab.training.parallel_args import (add_context_parallel_args, add_parallelism_args,
                                            check_context_parallel, check_parallel_sizes,
                                            check_pipeline_args)
from mpu_lab.training.recompute_args import (add_recompute_args, check_recompute_args,
                                             recompute_config_fields)
from mpu_lab.training.fsdp_args import add_megatron_fsdp_args, check_megatron_fsdp_args
from mpu_lab.training.moe_args import (add_moe_args, check_moe_args, expert_tensor_parallel_size,
                                       moe_config_fields)


def _add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    """Megatron's data parallelism: the distributed optimizer, overlapped gradient reduction, buckets."""
    g = p.add_argument_group("data parallelism (lab 04)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's distributed optimizer (ZeRO-1): gradients reduce-scattered, "
                        "each data-parallel rank updates its shard, parameters all-gathered")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each gradient bucket's reduction during backward, as soon as "
                        "the bucket is ready")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket (default, as Megatron: "
                        "max(40000000, 1000000 x data-parallel size))")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """Mock data or a text file."""
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true",
                   help="synthetic learnable data (the default when --data-path is not given)")
    g.add_argument("--data-path", default=None, help="a text file, read as bytes (vocab 256)")
    g.add_argument("--vocab-size", type=int, default=512, help="vocabulary of the mock data")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    """Batch sizes, iterations, the learning-rate schedule, AdamW, clipping, the seed."""
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


def _add_mixed_precision_args(p: argparse.ArgumentParser) -> None:
    """Fp16 / bf16 and the loss scale."""
    g = p.add_argument_group("precision")
    g.add_argument("--fp16", action="store_true", help="autocast to float16, dynamic loss scale")
    g.add_argument("--bf16", action="store_true", help="autocast to bfloat16")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16,
                   help="the fp16 loss scale at the start (Megatron-LM's default is 2^32, "
                        "which its first dozens of steps back off from)")
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="clean steps in a row before the loss scale doubles")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="overflows since the scale last grew before it is halved (each "
                        "overflowing step is skipped)")


def _add_logging_and_checkpointing_args(p: argparse.ArgumentParser) -> None:
    """Log lines, metrics, the timeline and breakdown reports, checkpoints."""
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--metrics-file", default=None,
                   help="append one JSON line per logged iteration (rank 0)")
    g.add_argument("--quiet", action="store_true", help="no per-iteration log lines")
    g.add_argument("--record-timeline", action="store_true",
                   help="PP > 1: every rank reports the forward/backward start and end times of "
                        "its last iteration (launcher.report), for a Gantt chart of the real run")
    g.add_argument("--breakdown", action="store_true",
                   help="every rank times its steps and the collectives in them and reports "
                        "the per-step breakdown (compute vs each kind of collective; "
                        "mpu_lab.perf.breakdown) under \"breakdown\"; the first step is not timed")
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


def _add_debugging_args(p: argparse.ArgumentParser) -> None:
    """The dense twin (lab 17)."""
    g = p.add_argument_group("debugging (lab 17)")
    g.add_argument("--dense-twin", action="store_true",
                   help="rank 0 also trains the dense TP=1 twin from the run's initial weights "
                        "and reports its per-iteration losses under \"dense_losses\" "
                        "(mpu_lab.labkit.debugging.twin_check.compare_with_dense_twin)")


# In the order of the help text.
ARGUMENT_GROUPS = (add_parallelism_args, add_context_parallel_args, add_moe_args,
                   _add_data_parallel_args, add_megatron_fsdp_args,
                   add_network_size_args, add_recompute_args, _add_data_args, _add_training_args,
                   _add_mixed_precision_args, _add_logging_and_checkpointing_args,
                   _add_debugging_args)


def build_parser(extra_args_provider: Optional[Callable[[argparse.ArgumentParser], Any]] = None
                 ) -> argparse.ArgumentParser:
    """The parser of ``launch/train_gpt.py``, one argument group at a time (as Megatron's
    ``parse_args``); ``extra_args_provider(parser)`` adds more (Megatron's own hook: lab 17's
    ``--inject-fault`` comes in this way, from :mod:`mpu_lab.training.faults`)."""
    p = flag_errors.ArgumentParser(
        prog="train_gpt.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train a small GPT with tensor/sequence/context/pipeline/data parallelism "
                    "(Megatron-style flags).")
    for add in ARGUMENT_GROUPS:
        add(p)
    if extra_args_provider is not None:
        extra_args_provider(p)
    return p


def parse_args(argv: Optional[Sequence[str]] = None,
               extra_args_provider: Optional[Callable[[argparse.ArgumentParser], Any]] = None
               ) -> argparse.Namespace:
    parser = build_parser(extra_args_provider)
    return parser.parse_args(None if argv is None else list(map(str, argv)))


def check_launch_args(argv: Sequence[str], world_size: int, cwd=None,
                      extra_args_provider: Optional[Callable[[argparse.ArgumentParser], Any]] = None
                      ) -> argparse.Namespace:
    """What ``launcher.run("train_gpt.py", argv, nproc=world_size)`` checks before torchrun
    starts: parse, :func:`validate_args`, and a ``--load`` checkpoint's files against the sums
    recorded at save (:func:`mpu_lab.training.checkpointing.verify_checkpoint`). Relative paths are
    taken from ``cwd``, the job's working folder, when given. The script's ``PRECHECK``
    (:func:`mpu_lab.training.faults.check_launch_args`) runs it with the fault flag added."""
    args = parse_args(argv, extra_args_provider)
    if cwd is not None:
        for name in ("data_path", "load"):
            value = getattr(args, name)
            if value and not os.path.isabs(value):
                setattr(args, name, os.path.join(str(cwd), value))
    validate_args(args, world_size)
    if args.load:
        checkpointing.verify_checkpoint(args.load)
    return args


def model_config(args) -> TransformerConfig:
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        activation=args.activation, sequence_parallel=args.sequence_parallel,
        layernorm_epsilon=args.layernorm_epsilon, init_method_std=args.init_method_std,
        context_parallel_size=getattr(args, "context_parallel_size", 1),
        cp_comm_type=getattr(args, "cp_comm_type", "p2p"), **moe_config_fields(args),
        **recompute_config_fields(args))


def validate_args(args: argparse.Namespace, world_size: int, check_load: bool = True
                  ) -> argparse.Namespace:
    """Check ``args`` for a job of ``world_size`` ranks and fill in the derived values
    (``data_parallel_size``, ``num_micro_batches``, ``padded_vocab_size``, ...).

    Pure: no ``torch.distributed``, so it runs in the notebook before ``torchrun`` starts.
    Raises ``ValueError`` naming the flags, their values and what would be valid: each value a
    :class:`~mpu_lab.training.flag_errors.FlagError` suggests is tried with the other flags as
    given and kept only if every check passes. Returns ``args``.
    """
    given = argparse.Namespace(**vars(args))
    try:
        return _validate(args, world_size, check_load)
    except FlagError as exc:
        raise exc.keeping(lambda flag, value: _works(given, world_size, flag, value)) from None


def _works(given: argparse.Namespace, world_size: int, flag: str, value) -> bool:
    """Whether the flags ``given`` pass every check with ``flag`` set to ``value`` (or on
    ``value`` ranks, for :data:`~mpu_lab.training.flag_errors.NPROC`)."""
    trial = argparse.Namespace(**vars(given))
    if flag == NPROC:
        world_size = value
    else:
        setattr(trial, flag.lstrip("-").replace("-", "_"), value)
    try:
        _validate(trial, world_size, check_load=False)
    except ValueError:
        return False
    return True


def _validate(args, world_size: int, check_load: bool) -> argparse.Namespace:
    """One check family per step, in this order (each may use what the ones before filled
    in)."""
    dp = check_parallel_sizes(args, world_size)
    check_model_args(args)
    check_recompute_args(args)
    model_config(args).check(args.tensor_model_parallel_size, args.seq_length)   # backstop
    check_context_parallel(args)
    check_moe_args(args, world_size, model_config(args))
    _fill_batch_sizes(args, world_size, dp)
    check_pipeline_args(args)
    check_megatron_fsdp_args(args)
    _check_optimizer_and_schedule(args)
    _check_data_parallel_options(args, dp * args.context_parallel_size)
    _check_save_interval(args)
    _check_vocabulary(args)
    _check_load(args, check_load)
    return args


def fewest_ranks(args) -> int:
    """The fewest ranks the parallel sizes fit: a multiple of TP x CP x PP and of the expert
    layers' etp x ep x pp."""
    pp = args.pipeline_model_parallel_size
    dense = args.tensor_model_parallel_size * getattr(args, "context_parallel_size", 1) * pp
    ep = getattr(args, "expert_model_parallel_size", 1)
    experts = expert_tensor_parallel_size(args) * ep * pp
    return math.lcm(max(1, dense), max(1, experts))


def parse_and_validate_args(argv: Optional[Sequence[str]] = None,
                            extra_args_provider: Optional[Callable[[argparse.ArgumentParser], Any]]
                            = None,
                            extra_checks: Sequence[Callable[[argparse.Namespace], Any]] = ()
                            ) -> argparse.Namespace:
    """What ``launch/train_gpt.py`` calls first, before any process group starts (the first two
    steps of Megatron's ``initialize_megatron``: ``parse_args``, ``validate_args``), for the
    world torchrun launched (``WORLD_SIZE``), then ``extra_checks(args)`` (lab 17's fault).

    A configuration that cannot work is refused: one message, printed by rank 0 only, exit
    status 2 on every rank (:func:`mpu_lab.training.flag_errors.refuse`). Under plain
    ``python`` it is refused too, after the flags are checked for :func:`fewest_ranks`, with
    the torchrun line that runs them."""
    def check(args, world_size):
        validate_args(args, world_size)
        for extra in extra_checks:
            extra(args)

    return flag_errors.parse_for_launch(build_parser(extra_args_provider), argv, check,
                                        fewest_ranks)


def _fill_batch_sizes(args, world_size: int, dp: int) -> None:
    """global batch = micro batch x micro-batches x DP: fills in ``global_batch_size`` (when
    not given), ``data_parallel_size``, ``num_micro_batches`` and ``world_size``."""
    mbs = args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    gbs = args.global_batch_size
    if gbs < 1 or gbs % (mbs * dp):
        raise FlagError(
            f"--global-batch-size {gbs} must be a multiple of micro batch size x data-parallel "
            f"size = {mbs} x {dp} = {mbs * dp} (global batch = micro batch x micro-batches x "
            f"DP)", {"--global-batch-size": [mbs * dp * k for k in (1, 2, 4)],
                     "--micro-batch-size": divisors(gbs // dp) if gbs >= dp and gbs % dp == 0
                     else []})
    args.data_parallel_size = dp
    args.num_micro_batches = gbs // (mbs * dp)
    args.world_size = world_size


def _check_optimizer_and_schedule(args) -> None:
    """Precision, learning rates and warmup (fills in ``lr_decay_iters`` and
    ``lr_warmup_steps``), clipping and weight decay."""
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
    if not 0 < args.min_loss_scale <= args.initial_loss_scale:
        raise ValueError(f"need 0 < --min-loss-scale ({args.min_loss_scale}) <= "
                         f"--initial-loss-scale ({args.initial_loss_scale})")
    if args.loss_scale_window < 1 or args.hysteresis < 1:
        raise ValueError(f"--loss-scale-window ({args.loss_scale_window}) and --hysteresis "
                         f"({args.hysteresis}) must be >= 1")
    if args.clip_grad < 0 or args.weight_decay < 0:
        raise ValueError(f"--clip-grad ({args.clip_grad}) and --weight-decay "
                         f"({args.weight_decay}) must be >= 0")


def _check_data_parallel_options(args, dp_cp: int) -> None:
    """``--ddp-bucket-size``: positive, and only with Megatron's data parallelism."""
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        raise ValueError(f"--ddp-bucket-size must be a positive number of elements, got "
                         f"{args.ddp_bucket_size} (leave it out for Megatron's default, "
                         f"max(40000000, 1000000 x DP x CP) = "
                         f"{max(40_000_000, 1_000_000 * dp_cp)})")
    if args.ddp_bucket_size is not None and not (args.use_distributed_optimizer
                                                 or args.overlap_grad_reduce):
        raise ValueError(f"--ddp-bucket-size {args.ddp_bucket_size} sizes the buckets of "
                         f"Megatron's data parallelism, used with --use-distributed-optimizer "
                         f"or --overlap-grad-reduce; add one of them (torch DDP, the default, "
                         f"has its own bucket_cap_mb)")


def _check_vocabulary(args) -> None:
    """The data file (``--data-path``: bytes, vocabulary 256) or the mock vocabulary, and its
    padding to a multiple of ``--make-vocab-size-divisible-by`` x TP (fills in
    ``padded_vocab_size``)."""
    tp = args.tensor_model_parallel_size
    if args.data_path:
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


def _check_save_interval(args) -> None:
    if args.save_interval is not None and (args.save_interval < 1 or not args.save):
        raise ValueError(f"--save-interval {args.save_interval} needs --save DIR and a value >= 1")


def _check_load(args, check_load: bool) -> None:
    """``--dense-twin`` cannot follow ``--load``; a ``--load`` checkpoint must be complete and
    fit the model (``check_load``)."""
    if getattr(args, "dense_twin", False) and args.load:
        raise ValueError(f"--dense-twin starts the twin from the run's initial weights; it "
                         f"cannot follow a run resumed with --load {args.load}")
    if check_load and args.load:
        # complete and compatible; the files' sums are checked once by check_launch_args
        # (before torchrun starts) and where they are read (checkpointing.load_checkpoint)
        path = checkpointing.find_checkpoint(args.load)
        checkpointing.check_compatible(checkpointing.read_checkpoint_info(path), args)


def vocab_padding_message(args) -> str:
    return (f"> padded vocab (size: {args.vocab_size}) with "
            f"{args.padded_vocab_size - args.vocab_size} dummy tokens (new size: "
            f"{args.padded_vocab_size}): a multiple of make_vocab_size_divisible_by x TP = "
            f"{args.make_vocab_size_divisible_by} x {args.tensor_model_parallel_size}, as Megatron does")
