"""The capstone: a tiny GPT trained twice from the same seed, once from the mirror's pieces and
once with the learner's own pieces (a folder of modules, ``--code``), and their losses compared
iteration by iteration (the lab kit's ``python -m mpu_lab.labkit.capstone`` runs this job and
prints its verdict).

    torchrun --standalone --nproc-per-node 4 launch/capstone.py --code labs/solutions \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --train-iters 3

The data-parallel size is what is left of the world: 8 ranks at t = p = 2 give d = 2.

The learner's folder is imported by file path as one package (its modules import each other
with ``from .mappings import ...``). Each piece found there replaces the mirror's through a seam
Megatron has or an explicit argument, never by rebinding a function:

* ``layers.py``: ``ColumnParallelLinear`` and ``RowParallelLinear`` through the layer spec
  (``get_gpt_layer_local_spec(column_parallel_linear=..., row_parallel_linear=...)``,
  Megatron-core's ``ModuleSpec``); ``VocabParallelEmbedding`` as the model's word embedding,
  built from the same draws of the default generator as the mirror's;
* ``cross_entropy.py`` (``vocab_parallel_cross_entropy``): the loss of the forward step;
* ``random.py`` (``checkpoint``): every layer recomputed in backward through it (a layer spec
  whose class takes the checkpoint function);
* ``schedules.py`` (``forward_backward_pipelining_without_interleaving``): the schedule called;
  lab 11's build, ``my_1f1b_loop``, stands for it where the folder has no such function
  (:func:`schedule_from_loop` gives it Megatron's arguments);
* ``distributed_data_parallel.py`` (``DistributedDataParallel``) and ``distrib_optimizer.py``
  (``DistributedOptimizer``): the gradient all-reduce and the optimizer step of each iteration.

Dropout is on (0.1), so the RNG states the checkpoint restores matter. If the learner's losses
part from the mirror's, the job looks for the piece: the ``mappings.py`` functions are compared
with the mirror's on the same inputs (outputs and input gradients), then each model piece is
swapped in alone and the run repeated. Two runs part where the loss or the gradient norm of an
iteration differs (Adam's step is blind to a gradient off by a constant factor; the norm is
not). Every rank reports ``{"runs": {run: {"loss": [...], "grad_norm": [...]}},
"first_parting": [iteration, "loss" | "grad_norm"] or None, "counts": {...}, "verdicts":
[...]}`` (:func:`mpu_lab.launcher.report`).
"""
import argparse
import importlib
import inspect
import pathlib
import sys
import types

import torch
import torch.distributed as dist

from mpu_lab import launcher
from mpu_lab.core import parallel_state as ps
from mpu_lab.core import tensor_parallel as mirror_tp
from mpu_lab.core.distributed import DistributedDataParallel as MirrorDDP
from mpu_lab.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from mpu_lab.core.models.gpt import build_model_chunks
from mpu_lab.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from mpu_lab.core.optimizer import build_optimizer
from mpu_lab.core.pipeline_parallel import allreduce_embedding_grads, sync_embedding_weights
from mpu_lab.core.pipeline_parallel.microbatch_steps import backward_step, forward_step
from mpu_lab.core.pipeline_parallel.utils import message_shape_and_dtype
from mpu_lab.core.pipeline_parallel.schedules import \
    forward_backward_pipelining_without_interleaving as mirror_1f1b
from mpu_lab.core.transformer import TransformerConfig
from mpu_lab.core.transformer.spec_utils import ModuleSpec
from mpu_lab.core.transformer.transformer_layer import TransformerLayer
from mpu_lab.training import initialize
from mpu_lab.training.code_folder import bound_p2p, defining_files, piece_source
from mpu_lab.training.flag_errors import refuse

# (module file, name) of each piece, in the order the verdict looks for a culprit
MAPPINGS = ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
            "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
            "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
            "reduce_scatter_to_sequence_parallel_region")
MODEL_PIECES = (("layers.py", "ColumnParallelLinear"), ("layers.py", "RowParallelLinear"),
                ("layers.py", "VocabParallelEmbedding"),
                ("cross_entropy.py", "vocab_parallel_cross_entropy"),
                ("random.py", "checkpoint"),
                ("schedules.py", "forward_backward_pipelining_without_interleaving"),
                ("distributed_data_parallel.py", "DistributedDataParallel"),
                ("distrib_optimizer.py", "DistributedOptimizer"))
PIECES = tuple(("mappings.py", n) for n in MAPPINGS) + MODEL_PIECES
PACKAGE = "capstone_learner_code"
# the tiny GPT: 2 layers per stage, width 32, 4 heads, sequence 16, vocabulary 64
HIDDEN, HEADS, SEQ, VOCAB, MICRO_BATCH, MICRO_BATCHES, LR = 32, 4, 16, 64, 2, 4, 3e-3


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code", default="", help="the learner's folder of modules ('' = none)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--train-iters", type=int, default=3)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="largest relative difference of a loss still called equal")
    return p.parse_args(argv)


def load_learner_pieces(folder):
    """``{name: (file, object, defining name)}`` of the pieces found in ``folder``, imported as
    one package by file path: each from the documented file, else from the one file that
    defines it; lab 11's ``my_1f1b_loop`` stands for the schedule (:func:`schedule_from_loop`)."""
    if not folder:
        return {}
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(folder)]
    sys.modules[PACKAGE] = package
    defined, found = defining_files(folder), {}
    for filename, name in PIECES:
        source = piece_source(defined, filename, name)
        if source is None:
            continue
        filename, defining = source
        obj = getattr(importlib.import_module(f"{PACKAGE}.{filename[:-3]}"), defining)
        found[name] = (filename, obj if defining == name else schedule_from_loop(obj), defining)
    return found


def schedule_from_loop(loop):
    """Lab 11's build, ``loop(stage, num_stages, num_microbatches, forward, backward, p2p)``,
    called as Megatron calls its schedule. The loop decides the order and the messages; it gets
    what lab 11's grader gave it: ``forward(input)`` and ``backward(input, output, output_grad)``
    are the mirror's ``forward_step`` and ``backward_step``, ``p2p`` the mirror's
    point-to-point functions with the message shape filled in."""
    def forward_backward_pipelining_without_interleaving(
            *, forward_step_func, data_iterator, model, num_microbatches, seq_length,
            micro_batch_size, **unused):
        shape, dtype = message_shape_and_dtype(model, seq_length, micro_batch_size)
        store = []

        def forward(input_tensor=None):
            return forward_step(forward_step_func, data_iterator, model, num_microbatches,
                                input_tensor, store)

        def backward(input_tensor, output_tensor, output_tensor_grad):
            return backward_step(input_tensor, output_tensor, output_tensor_grad)
        loop(ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
             num_microbatches, forward, backward, bound_p2p(shape, dtype))
        return store
    forward_backward_pipelining_without_interleaving.__wrapped__ = loop   # what count_uses counts
    return forward_backward_pipelining_without_interleaving


def mirror_pieces():
    pieces = {n: getattr(mirror_tp, n) for n in MAPPINGS}
    pieces.update(ColumnParallelLinear=mirror_tp.ColumnParallelLinear,
                  RowParallelLinear=mirror_tp.RowParallelLinear,
                  VocabParallelEmbedding=mirror_tp.VocabParallelEmbedding,
                  vocab_parallel_cross_entropy=mirror_tp.vocab_parallel_cross_entropy,
                  checkpoint=mirror_tp.checkpoint,
                  forward_backward_pipelining_without_interleaving=mirror_1f1b,
                  DistributedDataParallel=None, DistributedOptimizer=None)
    return pieces


class RecomputedTransformerLayer(TransformerLayer):
    """The mirror's layer, its forward run through ``checkpoint_function`` (the piece under
    test) so its activations are recomputed in backward."""

    def __init__(self, config, layer_number=0, submodules=None, checkpoint_function=None):
        super().__init__(config, layer_number, submodules=submodules)
        self.checkpoint_function = checkpoint_function

    def forward(self, hidden_states):
        if not self.training:
            return super().forward(hidden_states)
        return self.checkpoint_function(super().forward, False, hidden_states)


def model_config(a):
    """2 layers per stage; dropout on; sequence parallelism with ``--sequence-parallel``
    (then the sequence-parallel gather and reduce-scatter take the place of f and g)."""
    return TransformerConfig(num_layers=2 * a.pipeline_model_parallel_size, hidden_size=HIDDEN,
                             num_attention_heads=HEADS, hidden_dropout=0.1,
                             attention_dropout=0.1,
                             sequence_parallel=a.sequence_parallel)


def build(a, pieces):
    """This rank's model chunk, its DDP and optimizer, built from ``pieces``."""
    torch.manual_seed(a.seed)
    mirror_tp.model_parallel_manual_seed(a.seed)
    config = model_config(a)
    local = get_gpt_layer_local_spec(column_parallel_linear=pieces["ColumnParallelLinear"],
                                     row_parallel_linear=pieces["RowParallelLinear"])
    spec = ModuleSpec(module=RecomputedTransformerLayer, submodules=local.submodules,
                      params={"checkpoint_function": pieces["checkpoint"]})
    embedding = None
    if ps.is_pipeline_first_stage():      # the same draws as the model's own word embedding
        embedding = pieces["VocabParallelEmbedding"](
            VOCAB, HIDDEN, init_method=config.init_method(), params_dtype=config.params_dtype)
        torch.manual_seed(a.seed)
    (chunk,) = build_model_chunks(config, VOCAB, SEQ, transformer_layer_spec=spec)
    if embedding is not None:
        chunk.embedding.word_embeddings = embedding
    sync_embedding_weights([chunk])
    group = ps.get_data_parallel_group()
    if pieces["DistributedDataParallel"] is None:
        ddp = MirrorDDP(chunk, group, overlap_grad_reduce=True, bucket_size=40_000,
                        num_micro_batches=MICRO_BATCHES)
    else:
        ddp = pieces["DistributedDataParallel"](chunk, group, bucket_size=40_000,
                                                num_micro_batches=MICRO_BATCHES)
    if pieces["DistributedOptimizer"] is None:
        optimizer = build_optimizer(chunk, argparse.Namespace(
            lr=LR, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8))
    else:
        optimizer = pieces["DistributedOptimizer"](chunk.parameters(), group, lr=LR,
                                                   betas=(0.9, 0.999), eps=1e-8)
    return chunk, ddp, optimizer


def batches(a):
    """This data-parallel rank's micro-batches: random tokens, the same in every iteration
    (the model learns them by heart, so the loss falls) and every run (their own generator:
    the default one is the model's)."""
    d, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    g = torch.Generator().manual_seed(a.seed + 1)
    tokens = torch.randint(0, VOCAB, (d * MICRO_BATCHES, MICRO_BATCH, SEQ + 1),  # cpu: same draws anywhere
                           generator=g)
    device = initialize.get_device()
    return iter([(t[:, :-1].to(device), t[:, 1:].to(device))
                 for t in tokens[r * MICRO_BATCHES:(r + 1) * MICRO_BATCHES]])


def train(a, pieces):
    """Train ``a.train_iters`` iterations: ``{"loss": [...], "grad_norm": [...]}``, one number
    per iteration each, the same on every rank (what Megatron logs every iteration)."""
    chunk, ddp, optimizer = build(a, pieces)
    chunk.train()
    cross_entropy = pieces["vocab_parallel_cross_entropy"]
    labels_of = {}

    def forward_step(data_iterator, model):
        input_ids, labels = next(data_iterator)
        labels_of[id(model)] = labels
        output = model(input_ids)          # hidden states, or on the last stage [b, s, V/t]

        def loss_func(logits):
            loss = cross_entropy(logits.float(), labels_of[id(model)]).mean()
            return loss, {"lm loss": loss.detach()}
        return output, loss_func

    losses, norms = [], []
    for iteration in range(a.train_iters):
        ddp.zero_grad_buffer()
        reduced = pieces["forward_backward_pipelining_without_interleaving"](
            forward_step_func=forward_step, data_iterator=batches(a), model=chunk,
            num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
        ddp.finish_grad_sync()
        allreduce_sequence_parallel_grads(chunk)     # LayerNorms and row biases: over t
        allreduce_embedding_grads([chunk])           # the tied embedding: first + last stage
        norms.append(squared_grad_sum(chunk))
        optimizer.step()
        loss = torch.stack([r["lm loss"] for r in reduced]).mean() if reduced else torch.zeros((), device=initialize.get_device())
        losses.append(loss.to(initialize.get_device()))
    # the last stage's mean over data-parallel ranks, to every rank
    total = torch.stack(losses)
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    total /= ps.get_data_parallel_world_size()
    dist.broadcast(total, src=ps.get_pipeline_model_parallel_last_rank(),
                   group=ps.get_pipeline_model_parallel_group())
    norm = torch.stack(norms)
    dist.all_reduce(norm)
    return {"loss": [float(x) for x in total], "grad_norm": [float(x) for x in norm.sqrt()]}


def squared_grad_sum(chunk):
    """This rank's sum of squared gradients. Summed over every rank it is the norm of all the
    copies' gradients (replicas counted each time, alike in both runs): Adam's step hides a
    gradient off by a constant factor from the loss, the norm does not."""
    grads = [p.grad.float().pow(2).sum() for p in chunk.parameters() if p.grad is not None]
    return torch.stack(grads).sum() if grads else torch.zeros((), device=initialize.get_device())


def first_parting(reference, run, tolerance):
    """``(iteration, what)``: the first iteration (1-based) whose loss or gradient norm differs
    from the reference's by more than ``tolerance`` relative; None if none does."""
    for i in range(len(reference["loss"])):
        for what in ("loss", "grad_norm"):
            x, y = reference[what][i], run[what][i]
            if abs(x - y) > tolerance * max(abs(x), 1e-12):
                return i + 1, what
    return None


def count_uses(a, learner):
    """``{name: N}``: instances in this rank's model (classes) or calls in one iteration
    (functions), watched with ``sys.setprofile`` (nothing rebound)."""
    codes = {getattr(inspect.unwrap(obj), "__code__", None): name
             for name, (_, obj, _) in learner.items() if not isinstance(obj, type)}
    calls = dict.fromkeys(codes.values(), 0)

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            calls[codes[frame.f_code]] += 1
    one = argparse.Namespace(**{**vars(a), "train_iters": 1})
    pieces = {**mirror_pieces(), **{n: obj for n, (_, obj, _) in learner.items()}}
    sys.setprofile(profiler)
    try:
        train(one, pieces)
    finally:
        sys.setprofile(None)
    chunk, ddp, optimizer = build(one, pieces)
    objects = list(chunk.modules()) + [ddp, optimizer]
    for name, (_, obj, _) in learner.items():
        if isinstance(obj, type):
            calls[name] = sum(isinstance(m, obj) for m in objects)
    return calls


def check_mappings(learner, tolerance):
    """Each of the learner's ``mappings.py`` functions against the mirror's on the same inputs:
    ``[(name, "forward" | "backward", difference)]`` of those that differ on any rank."""
    t, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    device, found = initialize.get_device(), []
    for name in MAPPINGS:
        if name not in learner:
            continue
        g = torch.Generator().manual_seed(100 + r)
        x = torch.randn(4 * t, 2, 4 * t, generator=g).to(device)  # cpu: a CPU generator, then moved
        outputs, grads = [], []
        for fn in (learner[name][1], getattr(mirror_tp, name)):
            xi = x.clone().requires_grad_(True)
            y = fn(xi)
            dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(200 + r)  # cpu: as x
                             ).to(device)
            y.backward(dy)
            outputs.append(y.detach())
            grads.append(xi.grad)
        diffs = torch.tensor([_difference(*outputs), _difference(*grads)], device=device)
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        for where, diff in zip(("forward", "backward"), diffs.tolist()):
            if diff > tolerance:
                found.append((name, where, diff))
                break
    return found


def _difference(a, b):
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@launcher.entrypoint
def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.code and not pathlib.Path(a.code).is_dir():
        refuse("capstone.py", f"--code {a.code}: no such folder; give the folder of the "
                              f"learner's modules (the reference is labs/solutions)")
    info = initialize.init()
    ps.initialize_model_parallel(a.tensor_model_parallel_size, a.pipeline_model_parallel_size)
    learner = load_learner_pieces(a.code)
    runs = {"mirror": train(a, mirror_pieces())}
    runs["learner"] = train(a, {**mirror_pieces(), **{n: o for n, (_, o, _) in learner.items()}})
    parted = first_parting(runs["mirror"], runs["learner"], a.tolerance)
    verdicts = []
    if parted is not None:
        verdicts += [{"piece": n, "file": "mappings.py", "where": w, "difference": d}
                     for n, w, d in check_mappings(learner, a.tolerance)]
        for filename, name in MODEL_PIECES:
            if name not in learner:
                continue
            alone = {**mirror_pieces(), name: learner[name][1]}
            runs[name] = train(a, alone)
            at = first_parting(runs["mirror"], runs[name], a.tolerance)
            if at is not None:
                verdicts.append({"piece": learner[name][2], "file": learner[name][0],
                                 "where": "training", "iteration": at[0], "what": at[1]})
    counts = count_uses(a, learner)
    launcher.report({"rank": info.rank, "tp_rank": ps.get_tensor_model_parallel_rank(),
                     "pp_rank": ps.get_pipeline_model_parallel_rank(),
                     "dp_rank": ps.get_data_parallel_rank(), "runs": runs,
                     "first_parting": parted, "verdicts": verdicts,
                     "pieces": [name for _, name in PIECES],
                     "found": {n: f for n, (f, _, _) in learner.items()}, "counts": counts,
                     "defined_as": {n: d for n, (_, _, d) in learner.items() if d != n},
                     "tolerance": a.tolerance})
    if info.rank == 0:
        verdict = "is equal" if parted is None else f"parts at iteration {parted[0]}"
        print(f"capstone job: the learner's run {verdict} (losses: mirror "
              f"{[round(x, 6) for x in runs['mirror']['loss']]}, learner "
              f"{[round(x, 6) for x in runs['learner']['loss']]})")
    initialize.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
