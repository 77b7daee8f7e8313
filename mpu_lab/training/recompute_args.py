"""The activation-recomputation flags of ``launch/train_gpt.py`` (Megatron-LM's names, in
``_add_training_args`` of ``megatron/training/arguments.py``), their config fields and their
checks in flag names. ``--recompute-activations`` is Megatron-LM's short form of
``--recompute-granularity selective``.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict

from mpu_lab.core.transformer.transformer_config import (MEGATRON_RECOMPUTE_MODULES,
                                                        TransformerConfig)
from mpu_lab.training.flag_errors import FlagError

# config field -> flag, for messages in flag names
FLAGS = {"recompute_granularity": "--recompute-granularity",
         "recompute_method": "--recompute-method",
         "recompute_num_layers": "--recompute-num-layers",
         "recompute_modules": "--recompute-modules",
         "distribute_saved_activations": "--distribute-saved-activations",
         "sequence_parallel": "--sequence-parallel"}


def add_recompute_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("activation recomputation")
    g.add_argument("--recompute-activations", action="store_true",
                   help="selective recomputation of the attention core "
                        "(= --recompute-granularity selective)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="full: whole layers keep only their input; selective: "
                        "--recompute-modules in every layer")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="full only: uniform = layers in groups of --recompute-num-layers; "
                        "block = the first --recompute-num-layers layers of each stage")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="full only: the group size (uniform) or layers per stage (block)")
    g.add_argument("--recompute-modules", nargs="+", default=None,
                   choices=MEGATRON_RECOMPUTE_MODULES, metavar="MODULE",
                   help="selective only: what to recompute (default core_attn; mpu_lab builds "
                        "core_attn and mlp)")
    g.add_argument("--distribute-saved-activations", action="store_true",
                   help="full only: each tensor-parallel rank keeps 1/t of each saved input")


def recompute_config_fields(args) -> Dict[str, Any]:
    """The :class:`~mpu_lab.core.transformer.TransformerConfig` fields of the flags."""
    granularity = getattr(args, "recompute_granularity", None)
    if getattr(args, "recompute_activations", False) and granularity is None:
        granularity = "selective"
    return dict(recompute_granularity=granularity,
                recompute_method=getattr(args, "recompute_method", None),
                recompute_num_layers=getattr(args, "recompute_num_layers", None),
                recompute_modules=getattr(args, "recompute_modules", None),
                distribute_saved_activations=getattr(args, "distribute_saved_activations", False))


def in_flag_names(message: str) -> str:
    """A config check's message with the field names replaced by the flags."""
    for field, flag in sorted(FLAGS.items(), key=lambda kv: -len(kv[0])):
        message = message.replace(field, flag)
    return message


def check_recompute_args(args) -> None:
    """What the config would refuse, refused in flag names; and Megatron-LM's own rules (its
    ``validate_args``, not Megatron-core's config): ``--recompute-activations`` is selective,
    and ``--distribute-saved-activations`` needs tensor parallelism to split over and full
    recomputation, whose saved input it splits (with selective recomputation the config takes
    the field and nothing uses it)."""
    if getattr(args, "recompute_activations", False) and \
            getattr(args, "recompute_granularity", None) not in (None, "selective"):
        raise FlagError(f"--recompute-activations means --recompute-granularity selective, "
                         f"but --recompute-granularity {args.recompute_granularity} was given: "
                         f"keep one of the two")
    if getattr(args, "distribute_saved_activations", False) and \
            args.tensor_model_parallel_size == 1:
        raise FlagError("--distribute-saved-activations splits each saved input over the "
                        "tensor-parallel ranks: it needs --tensor-model-parallel-size > 1")
    granularity = recompute_config_fields(args)["recompute_granularity"]
    if getattr(args, "distribute_saved_activations", False) and granularity != "full":
        raise FlagError(f"--distribute-saved-activations splits the input that full "
                        f"recomputation saves: it needs --recompute-granularity full, got "
                        f"{granularity}")
    try:       # Megatron-core's own checks of the fields, on a config of one layer
        TransformerConfig(num_layers=1, hidden_size=1, num_attention_heads=1,
                          sequence_parallel=getattr(args, "sequence_parallel", False),
                          **recompute_config_fields(args))
    except ValueError as exc:
        raise FlagError(in_flag_names(str(exc))) from None
