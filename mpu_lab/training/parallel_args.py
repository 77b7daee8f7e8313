"""The parallelism flags of ``launch/train_gpt.py`` and their pure checks (part of Megatron's
``megatron/training/arguments.py``, kept apart so each module stays one topic): tensor,
pipeline, sequence and context parallelism (:func:`add_parallelism_args`,
:func:`add_context_parallel_args`), the sizes against the world (:func:`check_parallel_sizes`:
``world = TP x CP x DP x PP``, Megatron's ``tp-cp-dp-pp`` order) and what context parallelism
needs of the model (:func:`check_context_parallel`). No ``torch.distributed``: they run before
any process starts and raise ``ValueError`` naming the numbers and what would be valid."""
from __future__ import annotations

import argparse

from mpu_lab.core.context_parallel import COMM_TYPES
from mpu_lab.core.utils import divisors, nearest_multiples


def add_parallelism_args(p: argparse.ArgumentParser) -> None:
    """Tensor, pipeline (and virtual pipeline) and sequence parallelism."""
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


def add_context_parallel_args(p: argparse.ArgumentParser) -> None:
    """Context parallelism (Megatron's flags): the sequence split over ``cp`` ranks."""
    g = p.add_argument_group("context parallelism")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="ranks the sequence is split over (each holds chunks r and 2cp-1-r of "
                        "2cp); the weights stay whole, gradients are averaged over DP x CP")
    g.add_argument("--cp-comm-type", choices=COMM_TYPES, default="p2p",
                   help="how attention reaches the other CP ranks' tokens: p2p (ring of K/V "
                        "blocks), a2a (all-to-all to heads, Ulysses; heads divisible by TP x "
                        "CP) or allgather (all of K and V, Llama 3)")


def check_parallel_sizes(args, world_size: int) -> int:
    """The tensor-, context- and pipeline-parallel sizes against the world; returns the
    data-parallel size ``world_size / (TP x CP x PP)``."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = getattr(args, "context_parallel_size", 1)
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if tp < 1 or pp < 1 or cp < 1:
        raise ValueError(f"--tensor-model-parallel-size {tp}, --pipeline-model-parallel-size "
                         f"{pp} and --context-parallel-size {cp} must be >= 1")
    if cp > 1 and world_size % (tp * cp * pp):
        fixed = tp * pp
        valid = (f"valid context-parallel sizes are {divisors(world_size // fixed)}"
                 if world_size % fixed == 0 else
                 f"TP x PP = {fixed} does not divide {world_size} ranks either")
        raise ValueError(
            f"world size {world_size} is not divisible by tensor x context x pipeline parallel "
            f"size {tp} x {cp} x {pp} = {tp * cp * pp}; with {world_size} ranks, TP={tp} and "
            f"PP={pp} {valid}, or use a world size that is a multiple of {tp * cp * pp}")
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
    return world_size // (tp * cp * pp)


def check_context_parallel(args) -> None:
    """What context parallelism needs of the model's flags (after the model's own checks):
    the sequence in ``2 x cp`` equal chunks (each CP rank holds two), with sequence parallelism
    each rank's ``s/cp`` tokens split ``t`` ways, ``a2a`` heads in ``t x cp`` groups, and no
    attention dropout (the CP attention has none)."""
    cp, t, s = args.context_parallel_size, args.tensor_model_parallel_size, args.seq_length
    if cp == 1:
        return
    if s % (2 * cp):
        step = 2 * cp
        nearest = nearest_multiples(s, step)
        raise ValueError(
            f"--seq-length {s} is not divisible by 2 x --context-parallel-size = 2 x {cp} = "
            f"{step}: context parallelism cuts the sequence into 2*cp equal chunks (rank r keeps "
            f"chunks r and 2cp-1-r); use a multiple of {step}, e.g. {nearest}")
    if args.sequence_parallel and (s // cp) % t:
        step = 2 * cp * t
        raise ValueError(
            f"--sequence-parallel with --context-parallel-size {cp}: each CP rank holds "
            f"s/cp = {s} / {cp} = {s // cp} tokens, which sequence parallelism splits over "
            f"TP = {t} ranks; {s // cp} is not divisible by {t}: use a --seq-length that is a "
            f"multiple of 2 x CP x TP = {step}, e.g. {(s // step + 1) * step}")
    n = args.num_attention_heads
    if args.cp_comm_type == "a2a" and n % (t * cp):
        valid = [c for c in divisors(n // t) if c > 1] if n % t == 0 else []
        raise ValueError(
            f"--cp-comm-type a2a gives each of the TP x CP = {t} x {cp} = {t * cp} ranks of a "
            f"tensor- and context-parallel group whole heads: --num-attention-heads {n} is not "
            f"divisible by {t * cp}; use a head count that is a multiple of {t * cp}, "
            + (f"a context-parallel size in {valid}, " if valid else "")
            + "or --cp-comm-type p2p or allgather")
    if args.attention_dropout > 0:
        raise ValueError(f"--attention-dropout {args.attention_dropout} with "
                         f"--context-parallel-size {cp}: the context-parallel attention has no "
                         f"dropout; use --attention-dropout 0 (--hidden-dropout works with CP)")
