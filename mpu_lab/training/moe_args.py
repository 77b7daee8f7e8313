"""The mixture-of-experts flags of ``launch/train_gpt.py`` and their pure checks (Megatron's
``_add_moe_args`` in ``megatron/training/arguments.py``, same flag names): the experts, the
router and the token dispatcher (:func:`add_moe_args`), their config fields
(:func:`moe_config_fields`) and :func:`check_moe_args`, which refuses before any process
starts, in flag names, naming the numbers, what cannot be split (E over ep, ``ffn_hidden_size`` over etp, the
world over ``etp x ep x pp``) and what this trainer does not do with experts yet.

The expert groups (issue 31): ``world = etp x ep x edp x pp`` beside the dense
``world = t x cp x dp x pp``; ``--expert-tensor-parallel-size`` defaults to the
tensor-parallel size, as in Megatron-core.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict

from mpu_lab.core.utils import divisors
from mpu_lab.training.flag_errors import FlagError, multiples_near

DISPATCHERS = ("alltoall", "allgather")
SCORE_FUNCTIONS = ("softmax", "sigmoid")


def add_moe_args(p: argparse.ArgumentParser) -> None:
    """Megatron's MoE flags (a subset)."""
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None,
                   help="experts per MoE layer; every MLP becomes an MoE layer (default: dense)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts each token goes to")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="ranks the experts are spread over (each holds E / ep of them)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="ranks each expert's MLP is split over (default: the tensor-parallel size)")
    g.add_argument("--moe-token-dispatcher-type", choices=DISPATCHERS, default="alltoall")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="weight of the Switch load-balancing loss")
    g.add_argument("--moe-router-score-function", choices=SCORE_FUNCTIONS, default="softmax")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top-k (needed for top-1 softmax)")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="expert capacity in units of tokens x k / E; tokens beyond it dropped")


def moe_config_fields(args) -> Dict[str, Any]:
    """The :class:`~mpu_lab.core.transformer.transformer_config.TransformerConfig` fields of the flags."""
    return dict(num_moe_experts=getattr(args, "num_experts", None),
                moe_router_topk=getattr(args, "moe_router_topk", 2),
                moe_router_score_function=getattr(args, "moe_router_score_function", "softmax"),
                moe_router_pre_softmax=getattr(args, "moe_router_pre_softmax", False),
                moe_token_dispatcher_type=getattr(args, "moe_token_dispatcher_type", "alltoall"),
                moe_aux_loss_coeff=getattr(args, "moe_aux_loss_coeff", 0.0),
                moe_expert_capacity_factor=getattr(args, "moe_expert_capacity_factor", None))


def expert_tensor_parallel_size(args) -> int:
    """``--expert-tensor-parallel-size``, or the tensor-parallel size when not given."""
    etp = getattr(args, "expert_tensor_parallel_size", None)
    return args.tensor_model_parallel_size if etp is None else etp


EP, ETP, E = ("--expert-model-parallel-size", "--expert-tensor-parallel-size", "--num-experts")
MAX_TOPK = 8      # the --moe-router-topk values a refusal suggests at most


def check_moe_args(args, world_size: int, config) -> None:
    """The MoE flags against the world and the model, in flag names: the expert groups
    (``world = etp x ep x edp x pp``), E over ep, top-k, ``ffn_hidden_size`` over etp, SP with
    TP, top-1 softmax; then the model ``config``'s own ``check_moe`` (Megatron-core's names)
    as a backstop, and what this trainer refuses rather than trains wrong: context parallelism
    and the dense twin (which holds no experts)."""
    ep = getattr(args, "expert_model_parallel_size", 1)
    etp = expert_tensor_parallel_size(args)
    e = getattr(args, "num_experts", None)
    if e is None:
        given = [f for f, v in ((EP, ep != 1),
                                (ETP, getattr(args, "expert_tensor_parallel_size", None)
                                 is not None)) if v]
        if given:
            raise ValueError(f"{' and '.join(given)} need {E} (the model has no "
                             f"experts without it; every MLP is dense)")
        return
    if e < 1:
        raise ValueError(f"{E} must be >= 1, got {e} (leave it out for a dense model)")
    if ep < 1 or etp < 1:
        raise ValueError(f"{EP} {ep} and {ETP} {etp} must be >= 1")
    _check_expert_layout(args, world_size, e, ep, etp)
    _check_router(args, e)
    config.check_moe(ep, etp, args.tensor_model_parallel_size)
    refused = [(getattr(args, "context_parallel_size", 1) > 1,
                f"--context-parallel-size {getattr(args, 'context_parallel_size', 1)}"),
               (getattr(args, "dense_twin", False), "--dense-twin")]
    names = [name for bad, name in refused if bad]
    if names:
        raise ValueError(
            f"{E} {e} with {', '.join(names)}: not supported with experts yet (the "
            f"router's load-balancing loss counts no context-parallel ranks, and the dense twin "
            f"holds no experts); leave "
            f"{'it' if len(names) == 1 else 'them'} out")


def _check_expert_layout(args, world_size: int, e: int, ep: int, etp: int) -> None:
    """The expert groups tile the world, each expert-parallel rank holds whole experts, each
    expert's MLP splits over etp, and MoE with TP runs with sequence parallelism."""
    pp, t = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    if world_size % (etp * ep * pp):
        raise FlagError(
            f"{EP} {ep} does not fit {world_size} ranks: world size {world_size} is not "
            f"divisible by expert-tensor x expert-model x pipeline parallel size {etp} x {ep} x "
            f"{pp} = {etp * ep * pp} (the expert layers lay out world = etp x ep x edp x pp)",
            {EP: divisors(e), ETP: divisors(world_size) if etp > 1 else []})
    if e % ep:
        raise FlagError(f"{E} {e} is not divisible by {EP} {ep}: each of the {ep} "
                        f"expert-parallel ranks holds E / ep whole experts",
                        {EP: divisors(e), E: multiples_near(e, ep)})
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    if ffn % etp:
        raise FlagError(f"--ffn-hidden-size {ffn} is not divisible by {ETP} {etp}: each "
                        f"expert's fc1 is split into etp column blocks",
                        {ETP: divisors(ffn), "--ffn-hidden-size": multiples_near(ffn, etp)})
    if t > 1 and not args.sequence_parallel:
        raise FlagError(f"{E} {e} with --tensor-model-parallel-size {t} needs "
                        f"--sequence-parallel (Megatron-core's MoELayer refuses to train "
                        f"without it)", {"--sequence-parallel": [True]})


def _check_router(args, e: int) -> None:
    """Top-k within the experts, a router gradient at top-1, and the loss and capacity
    coefficients."""
    k = args.moe_router_topk
    if not 1 <= k <= e:
        raise FlagError(f"--moe-router-topk {k} must be in 1..{E} = 1..{e}: each token goes "
                        f"to k different experts",
                        {"--moe-router-topk": list(range(1, min(e, MAX_TOPK) + 1)),
                         E: [k] if k >= 1 else []})
    if k == 1 and args.moe_router_score_function == "softmax" and \
            not args.moe_router_pre_softmax:
        raise FlagError("--moe-router-topk 1 with the softmax score function needs "
                        "--moe-router-pre-softmax (a softmax over the one chosen logit is 1, "
                        "and the router would get no gradient)",
                        {"--moe-router-pre-softmax": [True],
                         "--moe-router-score-function": ["sigmoid"]})
    if args.moe_aux_loss_coeff < 0:
        raise ValueError(f"--moe-aux-loss-coeff must be >= 0, got {args.moe_aux_loss_coeff}")
    cf = args.moe_expert_capacity_factor
    if cf is not None and not cf > 0:
        raise ValueError(f"--moe-expert-capacity-factor must be > 0, got {cf} (leave it out "
                         f"for no capacity limit)")
