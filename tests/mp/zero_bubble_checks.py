"""torchrun worker: the zero-bubble schedules (ZBH1, ZBVZeroBubble) and DualPipeV against 1F1B
and against the one-process GPT, in one 4-rank job (gloo).

    torchrun --standalone --nproc-per-node 4 tests/mp/zero_bubble_checks.py FOLDER

Each layout's global batch is m = 2p micro-batches per data-parallel replica (the fewest every
schedule accepts): 8 at PP=2 x DP=2 and at PP=4, the first 4 of those at TP=2 x PP=2. Every rank
first computes the references: the TP=1/PP=1 GPTModel from the same seed, the mean loss over
the 8 and over the first 4 micro-batches, and every gradient. Then, re-initialising the
groups in the same processes, each of PP=2 x DP=2, PP=4, TP=2 x PP=2 and TP=2 x PP=2 with
sequence parallelism runs 1F1B, ZBH1, ZBVZeroBubble and DualPipeV over its global batch
(split over the data-parallel replicas) and reports, per schedule, the loss on
the rank holding the last stage (training and forward-only), the largest relative difference of
each gradient it holds from the reference (the reference's slice under TP) and from 1F1B's run,
the actions each rank ran (through the schedules' ``action_callback``) and, at the first W,
whether the linear layers' weight gradients were still waiting. Then GPT training through the
training loop (``training.setup`` / ``train``, PP=2 x DP=2, 3 iterations) with
``--pipeline-schedule`` 1f1b, zbh1, ZBVZeroBubble and dualpipev, each writing
``--timeline-file`` into FOLDER, and a ZBV run saved after 1 iteration and resumed under 1F1B
for 2 (the third's loss depends on the Adam moments read back).
tests/pipeline_parallel/test_zero_bubble_mp.py asserts.
"""
import pathlib
import sys

import torch

from mpu_lab import launcher
from mpu_lab.core import comm
from mpu_lab.core import parallel_state as ps
from mpu_lab.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from mpu_lab.core.models.gpt import GPTModel, build_model_chunks
from mpu_lab.core.pipeline_parallel import (
    allreduce_embedding_grads, get_forward_backward_func, sync_embedding_weights, unwrap_model)
from mpu_lab.core.pipeline_parallel.partition import stage_layers, v_stage_table
from mpu_lab.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mpu_lab.core.transformer.transformer_config import TransformerConfig
from mpu_lab import training
from mpu_lab.training import initialize
from mpu_lab.training.pipeline_timeline_file import PipelineTimelineFile
from mpu_lab.training.pipeline_v_chunks import build_v_model_chunks

CONFIG = dict(num_layers=8, hidden_size=32, num_attention_heads=4)
VOCAB, SEQ, MBS, SEED = 128, 16, 1, 1234
SCHEDULES = ("1F1B", "ZBH1", "ZBVZeroBubble", "DualPipeV")
# (TP, PP, sequence parallel); DP = 4 / (TP x PP)
LAYOUTS = [(1, 2, False), (1, 4, False), (2, 2, False), (2, 2, True)]


def microbatches(tp, pp):
    """The layout's global batch: m = 2p micro-batches for each of the DP = 4 / (TP x PP)
    replicas."""
    return 2 * pp * (4 // (tp * pp))


def batches(n):
    """The first ``n`` micro-batches of one fixed stream."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
        out.append({"tokens": ids[:, :-1].to(initialize.get_device()),
                    "position_ids": torch.arange(SEQ, device=initialize.get_device()),
                    "labels": ids[:, 1:].to(initialize.get_device())})
    return out


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    chunk = unwrap_model(model)
    labels = batch["labels"] if chunk.post_process else None
    if chunk.pre_process:
        output = model(batch["tokens"], batch["position_ids"], labels=labels)
    else:
        output = model(labels=labels)

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach()}
    return output, loss_func


def global_grads(chunk, layers):
    """``{name in the one-stage model: gradient}`` of one chunk holding global ``layers``."""
    out = {}
    for name, param in chunk.named_parameters():
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            name = f"decoder.layers.{layers.start + int(local)}.{rest}"
        if name == "output_layer_weight":
            name = "embedding.word_embeddings.weight"       # the tied copy: the same sum
        out[name] = param.grad.detach().clone()
    return out


def reference(n):
    """The one-process model's mean loss over the first ``n`` micro-batches and its gradients."""
    ps.initialize_model_parallel()
    torch.manual_seed(SEED)
    model = GPTModel(TransformerConfig(**CONFIG), VOCAB, SEQ).to(initialize.get_device())
    losses = [model(b["tokens"], b["position_ids"], labels=b["labels"]).float().mean()
              for b in batches(n)]
    loss = sum(losses) / len(losses)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    ps.destroy_model_parallel()
    return loss.item(), grads


def my_slice(dense, param):
    """The part of the one-stage model's tensor that this tensor-parallel rank holds."""
    if not getattr(param, "tensor_model_parallel", False):
        return dense
    t, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return dense.chunk(t, dim=param.partition_dim)[r]


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run(schedule, tp, pp, sp, dense_loss, dense_grads):
    r, dp, dp_rank = (ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_world_size(),
                      ps.get_data_parallel_rank())
    config = TransformerConfig(**CONFIG, sequence_parallel=sp)
    torch.manual_seed(SEED)
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        chunks = [c.to(initialize.get_device())
                  for c in build_v_model_chunks(config, VOCAB, SEQ, pp, r)]
        sync_embedding_weights(chunks)          # rank 0 holds both copies: a local copy
        layers = [row["layers"] for row in v_stage_table(CONFIG["num_layers"], pp)
                  if row["pp_rank"] == r]
    else:
        chunks = [c.to(initialize.get_device())
                  for c in build_model_chunks(config, VOCAB, SEQ)]
        sync_embedding_weights(chunks)
        layers = [stage_layers(CONFIG["num_layers"], pp, r)]
    m = microbatches(tp, pp) // dp
    mine = batches(microbatches(tp, pp))[dp_rank * m:(dp_rank + 1) * m]
    ran, first_w = [], []

    def seen(*action):      # the action; at the first W, whether its chunk's GEMMs still wait
        ran.append(list(action))
        if action[0] == "W" and not first_w:
            linears = [mod.weight for mod in chunks[action[2]].modules()
                       if isinstance(mod, (ColumnParallelLinear, RowParallelLinear))]
            norms = [mod.weight for mod in chunks[action[2]].modules()
                     if "LayerNorm" in type(mod).__name__]
            first_w.append(all(w.grad is None for w in linears) and
                           all(w.grad is not None for w in norms) and len(linears) > 0)
    store = get_forward_backward_func(schedule)(
        forward_step_func=forward_step,
        data_iterator=[iter(mine) for _ in chunks] if len(chunks) > 1 else iter(mine),
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=m, seq_length=SEQ,
        micro_batch_size=MBS, action_callback=seen)
    params = [p for c in chunks for p in c.parameters()]
    for p in params:            # data parallelism: the replicas' average (DDP's job in training)
        p.grad = comm.all_reduce(p.grad, group=ps.get_data_parallel_group()) / dp
    allreduce_embedding_grads(chunks)           # in a V: summed on rank 0 itself
    allreduce_sequence_parallel_grads(chunks)   # LayerNorms' partial sums under SP
    grads = {}
    for chunk, held in zip(chunks, layers):
        grads.update(global_grads(chunk, held))
    named = {n: p for chunk, held in zip(chunks, layers)
             for n, p in zip(global_grads(chunk, held), chunk.parameters())}
    out = dict(schedule=schedule, tp=tp, pp=pp, sp=sp, pp_rank=r, m=m, actions=ran, grad_rel=max(rel(g, my_slice(dense_grads[n], named[n]))
                                           for n, g in grads.items()),
               deferred_at_first_w=first_w[0] if first_w else None)
    for p in params:
        p.grad = None
    evaluated = get_forward_backward_func(schedule)(      # forward_only: the same loss, no grads
        forward_step_func=forward_step,
        data_iterator=[iter(mine) for _ in chunks] if len(chunks) > 1 else iter(mine),
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=m, seq_length=SEQ,
        micro_batch_size=MBS, forward_only=True)
    out["eval_no_grads"] = all(p.grad is None for p in params)
    for key, result in (("loss_rel", store), ("eval_rel", evaluated)):
        out[key] = None
        if result:
            loss = torch.tensor([sum(float(d["lm loss"]) for d in result) / len(result)],
                                device=initialize.get_device())
            loss = comm.all_reduce(loss, group=ps.get_data_parallel_group()) / dp
            out[key] = abs(loss.item() - dense_loss) / dense_loss
    return out, grads


def checks():
    references = {n: reference(n) for n in sorted({microbatches(tp, pp) for tp, pp, _ in LAYOUTS})}
    report = {"rank": torch.distributed.get_rank(), "runs": []}
    for tp, pp, sp in LAYOUTS:
        dense_loss, dense_grads = references[microbatches(tp, pp)]
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        baseline = None
        for schedule in SCHEDULES:
            out, grads = run(schedule, tp, pp, sp, dense_loss, dense_grads)
            if schedule == "1F1B":
                baseline = grads
            # Against 1F1B at the same layout: the same tensors wherever this rank holds them.
            common = [n for n in grads if n in baseline]
            out["vs_1f1b"] = max((rel(grads[n], baseline[n]) for n in common), default=0.0)
            report["runs"].append(out)
        ps.destroy_model_parallel()
    return report


TRAIN = ["--num-layers", 8, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 16,
         "--micro-batch-size", 1, "--global-batch-size", 8, "--vocab-size", 128,
         "--make-vocab-size-divisible-by", 32, "--lr", 3e-3, "--min-lr", 3e-4, "--train-iters", 3,
         "--log-interval", 1, "--quiet", "--pipeline-model-parallel-size", 2]


def train(*flags, train_iters=None):
    """``training.setup`` + ``train`` in this world; returns (stored schedule name, losses)."""
    args = training.validate_args(training.parse_args([str(f) for f in TRAIN + list(flags)]),
                                  torch.distributed.get_world_size())
    callbacks = [PipelineTimelineFile(args.timeline_file)] if args.timeline_file else []
    state = training.setup(args, log=lambda s: None)
    metrics = training.train(state, train_iters=train_iters, log=lambda s: None,
                             callbacks=callbacks)
    return args.pipeline_schedule, [m["lm_loss"] for m in metrics]


def training_runs(folder):
    out = {}
    for given in ("1f1b", "zbh1", "ZBVZeroBubble", "dualpipev"):
        out[given] = train("--pipeline-schedule", given,
                           "--timeline-file", folder / given / "timeline.json")
    ckpt = folder / "ckpt"
    out["zbv_saved"] = train("--pipeline-schedule", "zbvzerobubble", "--save", ckpt,
                             train_iters=1)
    out["resumed_1f1b"] = train("--pipeline-schedule", "1F1B", "--load", ckpt)
    return out


@launcher.entrypoint
def main():
    initialize.init()
    report = checks()
    report["training"] = training_runs(pathlib.Path(sys.argv[1]))
    launcher.report(report)
    initialize.shutdown()


if __name__ == "__main__":
    main()
