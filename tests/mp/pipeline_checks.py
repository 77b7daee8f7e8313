"""torchrun worker: pipeline p2p and every schedule against the single-process toy model.

    torchrun --standalone --nproc-per-node 4 tests/mp/pipeline_checks.py

One 4-rank job (gloo). PP=4 (DP=1) with 8 micro-batches and PP=2 (DP=2) with 4 micro-batches
per replica, each with GPipe, 1F1B and interleaved v=2, and two edge cases at PP=4: interleaved
with m = p (all forwards first) and 1F1B with m < p (micro-batches merged, so the global batch
stays the same): three SGD steps, comparing the loss and every gradient with ToyModel's at the
same global batch. The groups are re-initialised in the same processes for each (PP, v). A
ScheduleRecorder hooked on the chunks records the order each rank ran. Every rank reports a
dict; tests/pipeline_parallel/test_pipeline_mp.py asserts.
"""

import torch

from mpu_lab.core import comm
from mpu_lab.training import initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state as ps
from mpu_lab.perf.comm_counts import CollectiveLog
from mpu_lab.perf.pipeline_timeline import ScheduleRecorder
from mpu_lab.core.pipeline_parallel import (
    allreduce_embedding_grads, average_losses_across_microbatches, get_forward_backward_func,
    p2p_communication as p2p, sync_embedding_weights)
from mpu_lab.perf.pipeline_toy import (
    ToyConfig, ToyModel, build_toy_model_chunks, toy_batches, toy_forward_step)

CONFIG = ToyConfig(num_layers=8, hidden_size=16, vocab_size=32)
SEQ, MBS, GLOBAL_MICROBATCHES, ITERS, LR = 4, 2, 8, 3, 0.5
# (PP, v, schedule, micro-batches per replica; None: all of this replica's share of 8)
RUNS = [(4, None, "gpipe", None), (4, None, "1f1b", None), (4, 2, "interleaved", None),
        (2, None, "gpipe", None), (2, None, "1f1b", None), (2, 2, "interleaved", None),
        (4, 2, "interleaved", 4), (4, None, "1f1b", 2)]


def data(iteration):
    return toy_batches(CONFIG, GLOBAL_MICROBATCHES, SEQ, MBS, seed=100 + iteration,
                       device=initialize.get_device())


def dense_reference():
    """Losses and gradients of the one-process model, step by step (SGD)."""
    model = ToyModel(CONFIG).to(initialize.get_device())
    losses, grads = [], []
    for it in range(ITERS):
        model.zero_grad(set_to_none=True)
        batches = data(it)
        loss = sum(model(b["tokens"], b["labels"]) for b in batches) / len(batches)
        loss.backward()
        losses.append(loss.item())
        grads.append({"emb": model.word_embeddings.grad.clone(),
                      **{f"layer{n}.{k}": getattr(l, k).grad.clone()
                         for n, l in enumerate(model.layers) for k in ("weight", "bias")}})
        with torch.no_grad():
            for prm in model.parameters():
                prm -= LR * prm.grad
    with torch.no_grad():
        eval_loss = (sum(model(b["tokens"], b["labels"]) for b in data(ITERS)) / GLOBAL_MICROBATCHES).item()
    return losses, grads, eval_loss


def merged(batches, m):
    """``batches`` as ``m`` micro-batches: each group of equal size concatenated along the
    batch dimension (the mean loss over the global batch stays the same)."""
    k = len(batches) // m
    return [{key: torch.cat([b[key] for b in batches[i * k:(i + 1) * k]], dim=1) for key in batches[0]}
            for i in range(m)]


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def chunk_grads(chunks):
    out = {}
    for c in chunks:
        for n, layer in zip(c.layer_numbers, c.layers):
            for k in ("weight", "bias"):
                out[f"layer{n}.{k}"] = getattr(layer, k).grad
        if c.word_embeddings is not None:
            out["emb"] = c.word_embeddings.grad
    return out


def run_pipeline(pp, vpp, schedule, microbatches, reference):
    """ITERS SGD steps with the pipeline; returns what the test asserts on."""
    dense_losses, dense_grads, dense_eval = reference
    device = initialize.get_device()
    r, dp, dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_world_size(), \
        ps.get_data_parallel_rank()
    share = GLOBAL_MICROBATCHES // dp                       # this replica's micro-batches of MBS
    m = microbatches or share
    chunks = build_toy_model_chunks(ToyModel(CONFIG), r, pp, vpp, device=device)
    sync_embedding_weights(chunks)
    emb_synced = all(rel(c.word_embeddings, ToyModel(CONFIG).word_embeddings.to(device)) == 0
                     for c in chunks if c.word_embeddings is not None)
    forward_backward = get_forward_backward_func(schedule)
    # Watched from outside, with hooks on the chunks: the schedule itself records nothing.
    recorder = ScheduleRecorder(chunks, m, schedule)
    out = dict(pp=pp, vpp=vpp, schedule=schedule, pp_rank=r, dp_rank=dp_rank, m=m,
               emb_synced=emb_synced, loss_rel=[], grad_rel=[], fn=forward_backward.__name__)
    params = [prm for c in chunks for prm in c.parameters()]
    for it in range(ITERS):
        for prm in params:
            prm.grad = None
        mine = merged(data(it)[dp_rank * share:(dp_rank + 1) * share], m)
        iterators = [iter(mine) for _ in chunks]
        store = forward_backward(forward_step_func=toy_forward_step,
                                 data_iterator=iterators if vpp else iterators[0],
                                 model=chunks if vpp else chunks[0], num_microbatches=m,
                                 seq_length=SEQ, micro_batch_size=MBS * share // m,
                                 forward_only=False)
        # Data parallelism: average the replicas' gradients (DDP's job in training).
        for prm in params:
            prm.grad = comm.all_reduce(prm.grad, group=ps.get_data_parallel_group()) / dp
        allreduce_embedding_grads(chunks)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            loss = torch.tensor([average_losses_across_microbatches(store)["lm loss"]], device=device)
            loss = comm.all_reduce(loss, group=ps.get_data_parallel_group()) / dp
            out["loss_rel"].append(abs(loss.item() - dense_losses[it]) / dense_losses[it])
        else:
            assert store == [], store
        grads = chunk_grads(chunks)
        out["grad_rel"].append(max(rel(g, dense_grads[it][k]) for k, g in grads.items()))
        with torch.no_grad():
            for prm in params:
                prm -= LR * prm.grad
    out["records"] = [list(rec) for rec in recorder.records]         # the last iteration's
    out["peak_in_flight"] = recorder.peak_in_flight
    # Evaluation: forward_only leaves no gradients and gives the dense model's loss.
    for prm in params:
        prm.grad = None
    mine = merged(data(ITERS)[dp_rank * share:(dp_rank + 1) * share], m)
    store = forward_backward(forward_step_func=toy_forward_step,
                             data_iterator=[iter(mine) for _ in chunks] if vpp else iter(mine),
                             model=chunks if vpp else chunks[0], num_microbatches=m,
                             seq_length=SEQ, micro_batch_size=MBS * share // m, forward_only=True)
    out["eval_no_grads"] = all(prm.grad is None for prm in params)
    out["eval_order"] = [list(rec[:3]) for rec in recorder.records]
    recorder.remove()
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        loss = torch.tensor([average_losses_across_microbatches(store)["lm loss"]], device=device)
        loss = comm.all_reduce(loss, group=ps.get_data_parallel_group()) / dp
        out["eval_rel"] = abs(loss.item() - dense_eval) / dense_eval
    return out


def p2p_checks(pp):
    """The Megatron-named wrappers in a hand-written one-micro-batch pipeline, and all four
    messages at once (next == prev when pp == 2)."""
    device = initialize.get_device()
    r, shape = ps.get_pipeline_model_parallel_rank(), (2, 3, 4)
    weight = torch.full(shape, float(r + 2), device=device, requires_grad=True)
    out = {}
    # The messages are counted from outside, by torch's CommDebugMode (c10d send / recv ops).
    with CollectiveLog() as log:
        x = p2p.recv_forward(shape)                                   # None on the first stage
        x = x if x is not None else torch.ones(shape, device=device, requires_grad=True)
        y = x * weight
        p2p.send_forward(y, shape)
        g = p2p.recv_backward(shape)                                  # None on the last stage
        y.backward(g if g is not None else torch.ones(shape, device=device))
        p2p.send_backward(x.grad, shape)
    out["forward_value"] = float(x.detach().flatten()[0])            # product of (k+2), k < r
    out["weight_grad"] = float(weight.grad.flatten()[0])
    out["sends"], out["recvs"] = log.count("send"), log.count("recv")
    nxt, prv = ps.get_pipeline_model_parallel_next_rank(), ps.get_pipeline_model_parallel_prev_rank()
    act = torch.full(shape, 100.0 + r, device=device)
    grad = torch.full(shape, 200.0 + r, device=device)
    from_prev, from_next = p2p.communicate(tensor_send_next=act, tensor_send_prev=grad,
                                           recv_prev=True, recv_next=True, tensor_shape=shape)
    out["ring_ok"] = bool(torch.all(from_prev == 100.0 + ps.get_pipeline_model_parallel_rank() - 1
                                    if r > 0 else from_prev == 100.0 + pp - 1)
                          and torch.all(from_next == 200.0 + (r + 1) % pp)
                          and from_prev.requires_grad)
    out["ring_peers"] = [prv, nxt]
    try:
        p2p.communicate(tensor_send_next=torch.zeros(5, device=device), tensor_shape=shape)
        out["shape_error"] = None
    except ValueError as exc:
        out["shape_error"] = str(exc)
    return out


@launcher.entrypoint
def main():
    initialize.init()
    launcher.report(checks())
    initialize.shutdown()


def checks():
    """Every check above, in a world of 4 ranks already initialised; returns this rank's dict
    (also run by tests/mp/four_rank_checks.py, next to the other 4-rank checks)."""
    reference = dense_reference()
    report = {"runs": [], "p2p": {}}
    current = None
    for pp, vpp, schedule, microbatches in RUNS:
        if current != (pp, vpp):
            ps.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                         virtual_pipeline_model_parallel_size=vpp)
            current = (pp, vpp)
            if vpp is None and str(pp) not in report["p2p"]:
                report["p2p"][str(pp)] = p2p_checks(pp)
        report["runs"].append(run_pipeline(pp, vpp, schedule, microbatches, reference))
    return report


if __name__ == "__main__":
    main()
