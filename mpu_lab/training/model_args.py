"""The model's flags of ``launch/train_gpt.py`` (Megatron's ``_add_network_size_args``, same
flag names) and their pure check, :func:`check_model_args`: the shape against the
tensor-parallel size in flag names, before the model's own checks
(:meth:`~mpu_lab.core.transformer.transformer_config.TransformerConfig.check`, Megatron-core's
field names) run as a backstop. No ``torch.distributed``: a
:class:`~mpu_lab.training.flag_errors.FlagError` names the flags, their values and the values
that would fit."""
from __future__ import annotations

import argparse

from mpu_lab.core.utils import divisors
from mpu_lab.training.flag_errors import FlagError, multiples_near

TP = "--tensor-model-parallel-size"
HEADS = "--num-attention-heads"
MAX_HEADS = 128


def add_network_size_args(p: argparse.ArgumentParser) -> None:
    """The transformer's shape, dropout and initialisation."""
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


def check_model_args(args) -> None:
    """Positive sizes; ``D = n_H x H``; whole heads, FFN columns and (with
    ``--sequence-parallel``) sequence positions per tensor-parallel rank; dropout in [0, 1);
    the position table (fills in ``max_position_embeddings``)."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters", "log_interval"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.ffn_hidden_size is not None and args.ffn_hidden_size < 1:
        raise ValueError(f"--ffn-hidden-size must be >= 1, got {args.ffn_hidden_size} (leave it "
                         f"out for 4 x --hidden-size)")
    h, n, t, s = args.hidden_size, args.num_attention_heads, args.tensor_model_parallel_size, \
        args.seq_length
    if h % n:
        raise FlagError(f"--hidden-size {h} is not divisible by {HEADS} {n}: D = n_H x H needs "
                        f"a whole head dimension H",
                        {HEADS: [d for d in divisors(h) if d <= MAX_HEADS],
                         "--hidden-size": multiples_near(h, n)})
    if n % t:
        raise FlagError(f"{HEADS} {n} is not divisible by {TP} {t}: each rank must hold whole "
                        f"heads (the lecture's d_tp <= n_H, and n_H % d_tp == 0)",
                        {TP: divisors(n), HEADS: multiples_near(n, t)})
    ffn = args.ffn_hidden_size or 4 * h
    if ffn % t:
        given = "" if args.ffn_hidden_size else f" (4 x --hidden-size {h}, the default)"
        raise FlagError(f"--ffn-hidden-size {ffn}{given} is not divisible by {TP} {t}: each rank "
                        f"holds FFN / t columns of fc1",
                        {"--ffn-hidden-size": multiples_near(ffn, t), TP: divisors(ffn)})
    if args.sequence_parallel and s % t:
        raise FlagError(f"--sequence-parallel splits the sequence over the tensor-parallel "
                        f"group: --seq-length {s} is not divisible by {TP} {t}",
                        {"--seq-length": multiples_near(s, t), TP: divisors(s)})
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got "
                             f"{getattr(args, name)}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = s
    if args.max_position_embeddings < s:
        raise ValueError(f"--max-position-embeddings {args.max_position_embeddings} is smaller "
                         f"than --seq-length {s}: the position table needs a row per position; "
                         f"use >= {s} (or leave it out: default --seq-length)")
