"""torchrun worker: mpu_lab.core.context_parallel on 2 or 4 ranks, against a dense single-process
reference.

    torchrun --standalone --nproc-per-node 4 tests/mp/cp_checks.py

The whole world is first one CP group (cp = world size). Every rank builds the same full
``[s, b, n, d]`` q, k, v and output gradient (same seed), computes the reference -- full causal
attention over the whole sequence in fp64 with torch's SDPA, and its gradients -- then keeps
its own positions of everything (Megatron's layout, spelled out here by hand) and runs
``context_parallel.attention`` in fp32 on its part for every comm type, causal and not. The
errors ``max|cp - reference|`` of the output and of dq, dk, dv are reported, not asserted:
tests/context_parallel/test_context_parallel_mp.py asserts each where it reports it.

Then, at 4 ranks, the world is re-initialised with tp = 2, cp = 2 (CP groups [0, 2] and
[1, 3]: group ranks are not global ranks) and the checks run again, with the group passed
explicitly. Also reported: the positions ``get_batch_on_this_cp_rank`` keeps, and the errors
that bad inputs raise (before any collective: the job would hang otherwise).
The messages each comm type sends (calls and elements per function of mpu_lab.core.comm, forward
and backward) are counted by wrapping those functions from outside.
Every rank reports ``{"rank", "world", "attention", "batch", "bad_inputs", "messages"}``.
"""
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpu_lab.core import comm, context_parallel
from mpu_lab.training import initialize
from mpu_lab import launcher
from mpu_lab.core.comm import exchange
from mpu_lab.core import parallel_state as ps

BATCH, HEADS, HEAD_DIM = 2, 4, 8     # test_context_parallel_mp.py counts with these
CHUNK = 4                      # tokens per chunk: s = 2 * cp * CHUNK


def zigzag(seq_length, cp_rank, cp_size):
    """Positions of CP rank ``cp_rank``: chunk r, then chunk 2cp-1-r (independent of the mirror)."""
    c = seq_length // (2 * cp_size)
    front, back = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(front * c, front * c + c), torch.arange(back * c, back * c + c)])


def reference(seq_length, causal, seed):
    """Full q, k, v, dout ``[s, b, n, d]`` (fp64) and the dense output and q/k/v gradients."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(seq_length, BATCH, HEADS, HEAD_DIM, generator=gen,
                                 dtype=torch.float64) for _ in range(4))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in leaves),
                                         is_causal=causal).permute(2, 0, 1, 3)
    out.backward(dout)
    return (q, k, v, dout), (out.detach(), *(t.grad for t in leaves))


def attention_errors(comm_type, causal, cp_rank, cp_size, group, seed):
    seq_length = 2 * cp_size * CHUNK
    inputs, expected = reference(seq_length, causal, seed)
    mine = zigzag(seq_length, cp_rank, cp_size)
    q, k, v, dout = (t[mine].float() for t in inputs)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = context_parallel.attention(q, k, v, comm_type=comm_type, causal=causal, group=group)
    out.backward(dout)
    got = (out.detach(), q.grad, k.grad, v.grad)
    return {name: (g.double() - e[mine]).abs().max().item()
            for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected)}


def record(results, name, fn):
    try:
        results[name] = {"ok": True, "values": fn()}
    except Exception as exc:   # reported, so one failure does not hide the other checks
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()}


def attention_checks(results, prefix, group):
    cp_rank, cp_size = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
    for seed, comm_type in enumerate(context_parallel.COMM_TYPES):
        for causal in (True, False):
            record(results, f"{prefix}/{comm_type}/{'causal' if causal else 'full'}",
                   lambda: attention_errors(comm_type, causal, cp_rank, cp_size, group, seed))


def message_counts(cp_size):
    """``{comm_type: {"forward"|"backward": {function: [calls, elements sent]}}}`` of one
    causal attention call at s = 2*cp*CHUNK, counted by wrapping the functions of mpu_lab.core.comm
    and comm.exchange from outside (a call made inside another counted one is not counted twice)."""
    names = ("send_recv_async", "send_recv", "all_to_all", "all_gather", "reduce_scatter")
    home = {name: exchange if hasattr(exchange, name) else comm for name in names}
    originals = {name: getattr(home[name], name) for name in names}
    tally, depth = {}, [0]

    def counted(name):
        def call(tensor, *args, **kwargs):
            if depth[0] == 0:
                entry = tally.setdefault(name, [0, 0])
                entry[0] += 1
                entry[1] += tensor.numel()
            depth[0] += 1
            try:
                return originals[name](tensor, *args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    out = {}
    try:
        for name in names:
            setattr(home[name], name, counted(name))
        for comm_type in context_parallel.COMM_TYPES:
            q, k, v = (torch.randn(2 * CHUNK, BATCH, HEADS, HEAD_DIM, requires_grad=True)
                       for _ in range(3))
            tally.clear()
            result = context_parallel.attention(q, k, v, comm_type=comm_type)
            forward = {name: list(entry) for name, entry in tally.items()}
            tally.clear()
            result.sum().backward()
            out[comm_type] = {"forward": forward, "backward": dict(tally)}
    finally:
        for name, fn in originals.items():
            setattr(home[name], name, fn)
    return out


def batch_checks():
    """Positions each key keeps: tokens = position ids = 0..s-1, labels = 100 + position."""
    positions = torch.arange(16).repeat(BATCH, 1)                      # [b, s]
    batch = {"tokens": positions, "labels": positions + 100, "position_ids": positions,
             "loss_mask": (positions % 3 == 0).float(), "attention_mask": None}
    out = context_parallel.get_batch_on_this_cp_rank(batch)
    assert out["attention_mask"] is None
    assert all(torch.equal(out[k][0], out[k][1]) for k in ("tokens", "labels", "position_ids"))
    return {key: out[key][0].tolist() for key in ("tokens", "labels", "position_ids", "loss_mask")}


def raises(fn):
    """The message of the ValueError ``fn`` raises (None if it returns)."""
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def bad_input_checks():
    cp = ps.get_context_parallel_world_size()
    odd = torch.zeros(3, BATCH, HEADS, HEAD_DIM)
    few_heads = torch.zeros(2 * CHUNK, BATCH, cp + 1, HEAD_DIM)
    good = torch.zeros(2 * CHUNK, BATCH, HEADS, HEAD_DIM)
    out = {"odd_sequence": raises(lambda: context_parallel.attention(odd, odd, odd)),
           "a2a_heads": raises(lambda: context_parallel.attention(
               few_heads, few_heads, few_heads, comm_type="a2a")),
           "comm_type": raises(lambda: context_parallel.attention(good, good, good,
                                                                  comm_type="ring")),
           "batch_length": raises(lambda: context_parallel.get_batch_on_this_cp_rank(
               {"tokens": torch.zeros(BATCH, 2 * cp + 2, dtype=torch.long)}))}
    dist.barrier()     # every rank is still here: nothing above entered a collective
    return out


@launcher.entrypoint
def main():
    initialize.init()
    world = dist.get_world_size()
    ps.initialize_model_parallel(context_parallel_size=world)
    results = {}
    attention_checks(results, f"cp{world}", None)
    report = {"rank": dist.get_rank(), "world": world, "attention": results,
              "batch": batch_checks(), "bad_inputs": bad_input_checks(),
              "messages": message_counts(world)}
    if world == 4:
        ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
        report["tp2_cp_group"] = ps.get_group_ranks("cp")
        attention_checks(results, "tp2-cp2", ps.get_context_parallel_group())
    launcher.report(report)
    initialize.shutdown()


if __name__ == "__main__":
    main()
