"""The parallelism flags of ``launch/train_gpt.py`` and their pure checks (part of Megatron's
``megatron/training/arguments.py``, kept apart so each module stays one topic): tensor,
pipeline, sequence and context parallelism (:func:`add_parallelism_args`,
:func:`add_context_parallel_args`), the sizes against the world (:func:`check_parallel_sizes`:
``world = TP x CP x DP x PP``, Megatron's ``tp-cp-dp-pp`` order) and what context parallelism
needs of the model (:func:`check_context_parallel`), and the pipeline's layers, schedule and
micro-batches (:func:`check_pipeline_args`). No ``torch.distributed``: they run before
any process starts and raise :class:`~mpu_lab.training.flag_errors.FlagError` naming the flags,
their values and the values that would fit."""
from __future__ import annotations

import argparse

from mpu_lab.core.context_parallel import COMM_TYPES
from mpu_lab.core.pipeline_parallel import canonical_schedule, validate_pipeline_args
from mpu_lab.core.pipeline_parallel.partition import TORCH_NAMES, V_SCHEDULES, torch_schedule_name
from mpu_lab.core.utils import divisors
from mpu_lab.training.flag_errors import NPROC, FlagError, join_or, multiples_near


def add_parallelism_args(p: argparse.ArgumentParser) -> None:
    """Tensor, pipeline (and virtual pipeline) and sequence parallelism."""
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-schedule", default=None,
                   metavar="{" + ",".join(PIPELINE_SCHEDULES) + "}",
                   help="pipeline schedule (PP > 1), torch's names, any case: GPipe (all forwards, "
                        "then all backwards; alias afab), 1F1B (alias pipedream-flush), "
                        "Interleaved1F1B over virtual stages (alias interleaved), ZBH1 (zero "
                        "bubble, the backward split into input and weight gradients), "
                        "ZBVZeroBubble (two chunks per rank in a V: L divisible by 2 x PP), "
                        "DualPipeV (the same V, a forward paired with another micro-batch's "
                        "backward; micro-batches >= 2 x PP); "
                        "default as Megatron: Interleaved1F1B when "
                        "--num-layers-per-virtual-pipeline-stage is given, else 1F1B")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per model chunk for the interleaved schedule (Megatron's flag): "
                        "v = num_layers / PP / this")
    g.add_argument("--timeline-file", default=None, metavar="PATH",
                   help="write the actions each pipeline rank ran in the last iteration, in "
                        "order, as JSON {\"<rank>\": [[kind, microbatch, chunk], ...]} (kind F, "
                        "B, W, or BW for an unsplit backward); PP > 1; folder created")
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


TP, CP, PP = ("--tensor-model-parallel-size", "--context-parallel-size",
              "--pipeline-model-parallel-size")
# What --pipeline-schedule offers (torch's names).
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBH1", "ZBVZeroBubble", "DualPipeV")
SCHEDULE = "--pipeline-schedule"


def check_parallel_sizes(args, world_size: int) -> int:
    """The tensor-, context- and pipeline-parallel sizes against the world; returns the
    data-parallel size ``world_size / (TP x CP x PP)``."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = getattr(args, "context_parallel_size", 1)
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if tp < 1 or pp < 1 or cp < 1:
        raise ValueError(f"{TP} {tp}, {PP} {pp} and {CP} {cp} must be >= 1")
    model = tp * cp * pp
    if world_size % model:
        given = [(flag, size) for flag, size in ((TP, tp), (CP, cp), (PP, pp)) if size > 1]
        raise FlagError(
            f"{join_or([f'{f} {s}' for f, s in given], 'and')} "
            f"{'does' if len(given) == 1 else 'do'} not fit {world_size} ranks: world size "
            f"{world_size} is not divisible by "
            + (f"tensor x pipeline parallel size {tp} x {pp}" if cp == 1 else
               f"tensor x context x pipeline parallel size {tp} x {cp} x {pp}")
            + f" = {model} (world = TP x CP x DP x PP)",
            {**{flag: divisors(world_size) for flag, _ in given},
             NPROC: multiples_near(world_size, model)})
    return world_size // model


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
        raise FlagError(
            f"--seq-length {s} is not divisible by 2 x {CP} = 2 x {cp} = {step}: context "
            f"parallelism cuts the sequence into 2*cp equal chunks (rank r keeps chunks r and "
            f"2cp-1-r)", {"--seq-length": multiples_near(s, step),
                          CP: [c for c in divisors(s // 2) if c > 1] if s % 2 == 0 else []})
    if args.sequence_parallel and (s // cp) % t:
        step = 2 * cp * t
        raise FlagError(
            f"--sequence-parallel with {CP} {cp}: each CP rank holds s/cp = {s} / {cp} = "
            f"{s // cp} tokens, which sequence parallelism splits over TP = {t} ranks, and "
            f"{s // cp} is not divisible by {t} (a --seq-length that works is a multiple of "
            f"2 x CP x TP = {step})", {"--seq-length": multiples_near(s, step),
                                       TP: divisors(s // cp)})
    n = args.num_attention_heads
    if args.cp_comm_type == "a2a" and n % (t * cp):
        raise FlagError(
            f"--cp-comm-type a2a gives each of the TP x CP = {t} x {cp} = {t * cp} ranks of a "
            f"tensor- and context-parallel group whole heads: --num-attention-heads {n} is not "
            f"divisible by {t * cp}",
            {CP: [c for c in divisors(n // t) if c > 1] if n % t == 0 else [],
             "--num-attention-heads": multiples_near(n, t * cp),
             "--cp-comm-type": [c for c in COMM_TYPES if c != "a2a"]})
    if args.attention_dropout > 0:
        raise FlagError(f"--attention-dropout {args.attention_dropout} with {CP} {cp}: the "
                        f"context-parallel attention has no dropout (--hidden-dropout works "
                        f"with CP)", {"--attention-dropout": [0]})


def check_pipeline_args(args) -> None:
    """The pipeline in flag names (after the batch sizes are filled in): layers per stage and
    per model chunk, the schedule against the virtual stages, micro-batches for the
    interleaved schedule; then :func:`mpu_lab.core.pipeline_parallel.validate_pipeline_args`
    (Megatron-core's names, the flags given beside them) as a backstop. Fills in
    ``pipeline_schedule`` and ``virtual_pipeline_model_parallel_size``."""
    p, nlv, layers = args.pipeline_model_parallel_size, \
        args.num_layers_per_virtual_pipeline_stage, args.num_layers
    nlv_flag = "--num-layers-per-virtual-pipeline-stage"
    if p == 1:
        given = [f for f, v in (("--pipeline-schedule", args.pipeline_schedule),
                                (nlv_flag, nlv),
                                ("--timeline-file", getattr(args, "timeline_file", None)))
                 if v is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} {'need' if len(given) > 1 else 'needs'} "
                             f"{PP} > 1, got 1 (one stage runs its micro-batches one after the "
                             f"other)")
        args.virtual_pipeline_model_parallel_size = None
        return
    if layers % p:
        raise FlagError(f"--num-layers {layers} is not divisible by {PP} {p}: every stage "
                        f"needs the same number of layers",
                        {"--num-layers": multiples_near(layers, p), PP: divisors(layers)})
    per_stage, v = layers // p, 1
    if nlv is not None:
        if nlv < 1 or per_stage % nlv:
            raise FlagError(f"{nlv_flag} {nlv} does not divide the {per_stage} layers of each "
                            f"stage (--num-layers {layers} / {PP} {p})",
                            {nlv_flag: divisors(per_stage)})
        v = per_stage // nlv
    schedule = _schedule_of(args)
    _check_zero_bubble(args, schedule, p, per_stage)
    if schedule == "interleaved" and v == 1:
        raise FlagError(f"--pipeline-schedule interleaved needs 2 or more model chunks per "
                        f"stage: give {nlv_flag} (v = the {per_stage} layers per stage / it)",
                        {nlv_flag: [d for d in divisors(per_stage) if d < per_stage],
                         "--pipeline-schedule": ["1f1b"]})
    if v > 1 and schedule not in (None, "interleaved"):
        raise FlagError(f"--pipeline-schedule {args.pipeline_schedule} runs one model chunk per "
                        f"stage, but {nlv_flag} {nlv} makes {v} chunks of each stage's "
                        f"{per_stage} layers", {"--pipeline-schedule": ["interleaved"],
                                                 nlv_flag: [None]})
    m, dp = args.num_micro_batches, args.data_parallel_size
    if v > 1 and m % p:
        mbs = args.micro_batch_size
        raise FlagError(f"the interleaved schedule runs the micro-batches in groups of {PP} "
                        f"{p}: --global-batch-size {args.global_batch_size} / (--micro-batch-size "
                        f"{mbs} x DP {dp}) = {m} micro-batches per step, not divisible by {p}",
                        {"--global-batch-size": [mbs * dp * p * k for k in (1, 2, 4)]})
    try:
        pipe = validate_pipeline_args(
            num_layers=layers, pipeline_model_parallel_size=p,
            global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
            data_parallel_size=dp, schedule=args.pipeline_schedule,
            num_layers_per_virtual_pipeline_stage=nlv)
    except ValueError as exc:
        raise ValueError(
            f"{exc} [here: --num-layers {layers}, {PP} {p}, {nlv_flag} {nlv}, "
            f"--pipeline-schedule {args.pipeline_schedule}, micro-batches per step = "
            f"--global-batch-size {args.global_batch_size} / (--micro-batch-size "
            f"{args.micro_batch_size} x DP {dp}) = {m}]") from None
    args.pipeline_schedule = torch_schedule_name(pipe["schedule"])   # printed and stored
    args.virtual_pipeline_model_parallel_size = pipe["virtual_pipeline_model_parallel_size"]


def _schedule_of(args):
    """The canonical name of ``--pipeline-schedule`` (None when not given); refuses unknown
    names in flag names."""
    given = args.pipeline_schedule
    if given is None:
        return None
    try:
        return canonical_schedule(given)
    except ValueError:
        raise FlagError(f"{SCHEDULE} {given} is not a pipeline schedule; choose one of "
                        f"{', '.join(PIPELINE_SCHEDULES)} (any case)",
                        {SCHEDULE: list(PIPELINE_SCHEDULES)}) from None


def _check_zero_bubble(args, schedule, p: int, per_stage: int) -> None:
    """What the zero-bubble schedules need: a V cuts the ``L`` layers into ``2 x PP`` chunks;
    DualPipeV runs at least ``2 x PP`` micro-batches (torch's rule); the deferred weight gradients reach the gradient buffer after the backward hooks that
    ``--overlap-grad-reduce`` and Megatron FSDP start their reductions from."""
    if schedule not in ("zbh1",) + V_SCHEDULES:
        return
    name, layers = TORCH_NAMES[schedule], args.num_layers
    if schedule in V_SCHEDULES and layers % (2 * p):
        raise FlagError(f"{SCHEDULE} {name} cuts the model into 2 x {PP} {p} = {2 * p} chunks "
                        f"of equal size (two per rank, in a V), and --num-layers {layers} is "
                        f"not divisible by {2 * p}",
                        {"--num-layers": multiples_near(layers, 2 * p),
                         PP: [d for d in divisors(layers // 2) if d > 1] if layers % 2 == 0
                         else [], SCHEDULE: ["1F1B", "ZBH1"]})
    m, dp, mbs = args.num_micro_batches, args.data_parallel_size, args.micro_batch_size
    if schedule == "dualpipev" and m < 2 * p:
        raise FlagError(f"{SCHEDULE} DualPipeV needs at least 2 x {PP} {p} = {2 * p} "
                        f"micro-batches per step (one per stage), and --global-batch-size "
                        f"{args.global_batch_size} / (--micro-batch-size {mbs} x DP {dp}) = {m}",
                        {"--global-batch-size": [mbs * dp * 2 * p * k for k in (1, 2)],
                         SCHEDULE: ["ZBVZeroBubble", "ZBH1"]})
    for flag in ("overlap_grad_reduce", "use_megatron_fsdp"):
        if getattr(args, flag, False):
            option = "--" + flag.replace("_", "-")
            raise FlagError(f"{SCHEDULE} {name} with {option}: the schedule computes weight "
                            f"gradients after the backward hooks that {option} reduces from",
                            {option: [False], SCHEDULE: ["1F1B"]})
    if getattr(args, "record_timeline", False):
        raise FlagError(f"{SCHEDULE} {name} with --record-timeline: its recorder times each "
                        f"backward by gradient hooks that the deferred weight gradients skip; "
                        f"--timeline-file PATH writes the F, B and W each rank ran",
                        {"--record-timeline": [False], SCHEDULE: ["1F1B"]})
