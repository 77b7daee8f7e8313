"""torchrun worker: mpu_lab.core.tensor_parallel on 8 ranks, in the two layouts of Megatron's tests.

    torchrun --standalone --nproc-per-node 8 tests/mp/tp_checks.py

For tp=4/pp=2 and then tp=2/pp=4 (model parallel re-initialised in between) every check runs
on every rank, asserts, and records ``{"ok", "values"}`` (or ``{"ok": False, "error"}``);
the dict ``{"rank", "checks": {"tp4-pp2/copy_to_backward": ..., ...}}`` goes back through
:func:`mpu_lab.launcher.report`, and tests/tensor_parallel/test_tensor_parallel_mp.py checks it
rank by rank.
Dense twins are built from the layers' master weights. Tolerances are for fp32: an error is
``max|parallel - dense| / max(1, max|dense|)`` and must be <= 1e-6.
A failed assertion is recorded and the run goes on to the next check, so one bug does not
hide the others; if it struck some ranks mid-check, later checks can fail in its wake (or
time out after ``MPU_LAB_TIMEOUT_S``): read the first failure. ``--keep-going`` exits 0 even
then, so the test sees each check's result.
"""
import argparse
import sys
import traceback
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpu_lab.core import comm
from mpu_lab.training import initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state as ps
from mpu_lab.core import tensor_parallel as tp
from mpu_lab.perf.comm_counts import CollectiveLog
from mpu_lab.core.tensor_parallel import mappings

LAYOUTS = ((4, 2), (2, 4))  # (tensor, pipeline) model-parallel sizes on 8 ranks
TOL = 1e-6
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


# --------------------------------------------------------------------------- helpers
def me():
    """(global rank, tp rank, tp size, global ranks of my tp group)."""
    return (dist.get_rank(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(), ps.get_group_ranks("tp"))


def close(actual, expected, what):
    """The error ``max|actual - expected| / max(1, max|expected|)``, asserted <= TOL: absolute
    for values up to 1, relative above (an fp32 ulp of 4.0 is already 4.8e-7)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).abs().max().item()
    scale = max(1.0, expected.abs().max().item())
    assert err <= TOL * scale, f"{what}: max error {err:.3g} > {TOL:g} x {scale:.3g}"
    return err / scale


def filled(values, n):
    """Concatenation of ``n`` copies of each value: [v0]*n + [v1]*n + ..."""
    return torch.cat([torch.full((n,), float(v)) for v in values])


def ctx(**saved):
    """What an autograd Function's ``forward`` keeps for ``backward``: the tensor-parallel group
    and ``saved`` (Megatron-core's tests call ``backward`` with such a stand-in)."""
    return types.SimpleNamespace(group=ps.get_tensor_model_parallel_group(), **saved)


def gather_tp(t):
    """Every tp rank's ``t`` stacked along a new dim 0 (no autograd)."""
    return comm.all_gather(t.detach().unsqueeze(0), group=ps.get_tensor_model_parallel_group())


# --------------------------------------------------------------------------- Megatron's unit tests
@check
def copy_to_backward():
    rank, _, _, group = me()
    x = torch.ones(1) * rank
    expected = torch.ones(1) * sum(group)            # 6 on ranks 0-3, 22 on 4-7 for tp=4
    out, none = mappings._CopyToModelParallelRegion.backward(ctx(), x)
    assert torch.equal(out, expected), f"backward gave {out.tolist()}, expected {expected.tolist()}"
    assert none is None                               # no gradient for the group argument
    assert torch.equal(tp.copy_to_tensor_model_parallel_region(x), x)
    leaf = torch.zeros(1, requires_grad=True)         # the same through autograd
    tp.copy_to_tensor_model_parallel_region(leaf).backward(x)
    assert torch.equal(leaf.grad, expected), f"autograd gave {leaf.grad.tolist()}"
    return out.item()


@check
def reduce_from_forward():
    rank, _, _, group = me()
    x = torch.ones(1) * rank
    out = tp.reduce_from_tensor_model_parallel_region(x)
    assert torch.equal(out, torch.ones(1) * sum(group)), f"forward gave {out.tolist()}"
    assert torch.equal(mappings._ReduceFromModelParallelRegion.backward(ctx(), x)[0], x)
    leaf = torch.zeros(1, requires_grad=True)         # backward is the identity
    tp.reduce_from_tensor_model_parallel_region(leaf).backward(x)
    assert torch.equal(leaf.grad, x)
    return out.item()


@check
def scatter_keeps_own_column():
    rank, r, t, group = me()
    x = torch.arange(8 * t, dtype=torch.float32).view(8, t) + 100 * rank   # x[i, j] = t*i + j + 100*rank
    out = tp.scatter_to_tensor_model_parallel_region(x)
    assert torch.equal(out, x[:, r:r + 1]), f"kept {out[:, 0].tolist()}"
    back = mappings._ScatterToModelParallelRegion.backward(ctx(), torch.ones(8) * rank)[0]
    assert torch.equal(back, filled(group, 8)), "backward is not the all-gather of the group"
    return int(out[0, 0].item()) - 100 * rank                              # the column index kept


@check
def gather_concatenates_group():
    rank, r, t, group = me()
    out = tp.gather_from_tensor_model_parallel_region(torch.ones(8) * rank)
    assert torch.equal(out, filled(group, 8)), f"gathered {out[::8].tolist()}"
    y = torch.rand(8, t)
    assert torch.equal(mappings._GatherFromModelParallelRegion.backward(ctx(), y)[0], y[:, r:r + 1])
    return [int(v) for v in out[::8].tolist()]


@check
def sequence_parallel_trio():
    rank, r, t, group = me()
    # scatter: this rank's 2 rows of a (2t, 4) sequence; backward all-gathers dim 0
    x = torch.rand(2 * t, 4)
    assert torch.equal(tp.scatter_to_sequence_parallel_region(x), x[2 * r:2 * r + 2])
    back = mappings._ScatterToSequenceParallelRegion.backward(ctx(), torch.ones(4) * rank)[0]
    assert torch.equal(back, filled(group, 4))
    # gather: concatenate along dim 0; backward reduce-scatters (or only splits)
    out = tp.gather_from_sequence_parallel_region(torch.ones(4) * rank)
    assert torch.equal(out, filled(group, 4)), f"gathered {out[::4].tolist()}"
    rows = torch.vstack([torch.ones(4) * i for i in range(t)])          # row i holds i
    saved = ctx(tensor_parallel_output_grad=True)
    grad = mappings._GatherFromSequenceParallelRegion.backward(saved, rows)[0]
    assert torch.equal(grad, torch.ones(1, 4) * t * r), f"reduce-scattered {grad.tolist()}"
    saved.tensor_parallel_output_grad = False
    grad = mappings._GatherFromSequenceParallelRegion.backward(saved, rows)[0]
    assert torch.equal(grad, torch.ones(1, 4) * r), f"split {grad.tolist()}"
    # reduce-scatter: sum over the group, keep row r; backward all-gathers
    out = tp.reduce_scatter_to_sequence_parallel_region(rows)
    assert torch.equal(out, torch.ones(1, 4) * t * r), f"reduce-scattered {out.tolist()}"
    back = mappings._ReduceScatterToSequenceParallelRegion.backward(ctx(), torch.ones(4) * rank)[0]
    assert torch.equal(back, filled(group, 4))
    return {"scatter_rows": [2 * r, 2 * r + 2], "reduce_scatter_value": out[0, 0].item()}


@check
def broadcast_data():
    rank, r, _, group = me()
    src = ps.get_tensor_model_parallel_src_rank()
    # Megatron's test: float keys 0 and 1 of a dict every rank holds
    same = {k: torch.ones(8, 8) * k for k in range(8)}
    out = tp.broadcast_data([0, 1], same, torch.float32)
    assert torch.equal(out[0], same[0]) and torch.equal(out[1], same[1])
    # only the source reads its data; the others pass None and receive the source's
    data = None
    if r == 0:
        data = {"tokens": torch.arange(10).view(2, 5) + 1000 * rank,
                "labels": torch.arange(3 * 2 * 4).view(3, 2, 4) - rank}
    out = tp.broadcast_data(["tokens", "labels"], data, torch.int64)
    assert torch.equal(out["tokens"], torch.arange(10).view(2, 5) + 1000 * src)
    assert torch.equal(out["labels"], torch.arange(24).view(3, 2, 4) - src)
    return {"src": src, "tokens00": int(out["tokens"][0, 0])}


@check
def gather_split_1d():
    rank, r, t, group = me()
    out = tp.gather_split_1d_tensor(torch.ones(2, 4) * rank)
    assert torch.equal(out, filled(group, 8)), f"gathered {out.tolist()}"
    full = torch.arange(6 * t, dtype=torch.float32).view(3, 2 * t)        # the same on every rank
    chunk = tp.split_tensor_into_1d_equal_chunks(full, new_buffer=True)
    assert torch.equal(chunk, full.reshape(-1)[6 * r:6 * r + 6])
    assert torch.equal(tp.gather_split_1d_tensor(chunk), full.reshape(-1))
    return [int(v) for v in out[::8].tolist()]


# --------------------------------------------------------------------------- layers vs dense twins
@check
def column_parallel_matches_dense():
    _, r, t, _ = me()
    torch.manual_seed(11)                               # the same master weight on every rank
    col = tp.ColumnParallelLinear(32, 48, keep_master_weight_for_test=True)
    bias = torch.randn(48)                              # non-zero, to test where it is added
    with torch.no_grad():
        col.bias.copy_(bias.chunk(t)[r])
    x = torch.randn(4, 3, 32)                           # [s, b, h]
    x_tp = x.clone().requires_grad_()
    y, out_bias = col(x_tp)
    assert out_bias is None
    w = col.master_weight.clone().requires_grad_()
    b = bias.clone().requires_grad_()
    x_d = x.clone().requires_grad_()
    y_d = F.linear(x_d, w, b)                           # the dense twin, same op
    assert torch.equal(y, y_d), f"gathered output differs by {(y - y_d).abs().max().item():.3g}"
    dy = torch.randn_like(y)
    y.backward(dy)
    y_d.backward(dy)
    errors = {"input_grad": close(x_tp.grad, x_d.grad, "input grad"),
              "weight_grad": close(col.weight.grad, w.grad.chunk(t, 0)[r], "weight grad"),
              "bias_grad": close(col.bias.grad, b.grad.chunk(t)[r], "bias grad")}
    # gather_output=False keeps this rank's columns; skip_bias_add hands the bias back
    col.gather_output, col.skip_bias_add = False, True
    y_part, out_bias = col(x)
    assert out_bias is col.bias
    assert torch.equal(y_part, F.linear(x, col.weight)), "local output is not X A_i"
    return {"bit_exact": True, **errors}


@check
def row_parallel_matches_dense():
    _, r, t, _ = me()
    torch.manual_seed(12)
    row = tp.RowParallelLinear(64, 24, keep_master_weight_for_test=True)
    bias = torch.randn(24)
    with torch.no_grad():
        row.bias.copy_(bias)                            # full size on every rank
    x = torch.randn(4, 3, 64)
    x_tp = x.clone().requires_grad_()
    y, out_bias = row(x_tp)
    assert out_bias is None
    w = row.master_weight.clone().requires_grad_()
    b = bias.clone().requires_grad_()
    x_d = x.clone().requires_grad_()
    y_d = F.linear(x_d, w, b)
    errors = {"output": close(y, y_d, "output")}
    dy = torch.randn_like(y)
    y.backward(dy)
    y_d.backward(dy)
    errors["input_grad"] = close(x_tp.grad, x_d.grad, "input grad")
    errors["weight_grad"] = close(row.weight.grad, w.grad.chunk(t, 1)[r], "weight grad")
    errors["bias_grad"] = close(row.bias.grad, b.grad, "bias grad")
    # input_is_parallel: feed this rank's slice; skip_bias_add: the sum without the bias
    row.input_is_parallel, row.skip_bias_add = True, True
    y_sum, out_bias = row(x.chunk(t, -1)[r])
    assert out_bias is row.bias
    errors["output_without_bias"] = close(y_sum, F.linear(x, w.detach()), "output without bias")
    return errors


def _expected_indices(size, per_partition, stride, r, t):
    """Indices of the master's rows (columns) that rank r of t keeps, spelled out by hand."""
    piece = per_partition // stride
    return [p * piece + j for p in range(r, t * stride, t) for j in range(piece)]


@check
def shards_are_master_slices():
    _, r, t, _ = me()
    shapes = {}
    for stride in (1, 3):
        # column: rows of the (out, in) master; out = 24 splits for t in {2, 4} and stride 3
        torch.manual_seed(5)
        col = tp.ColumnParallelLinear(16, 24, stride=stride, keep_master_weight_for_test=True)
        torch.manual_seed(5)
        dense = torch.empty(24, 16)
        torch.nn.init.xavier_normal_(dense)             # the TP=1 weight, built the same way
        assert torch.equal(col.master_weight, dense)
        rows = _expected_indices(24, 24 // t, stride, r, t)
        assert torch.equal(col.weight, dense[rows]), f"stride {stride}: column shard is not rows {rows}"
        assert (col.weight.tensor_model_parallel, col.weight.partition_dim,
                col.weight.partition_stride) == (True, 0, stride)
        # row: columns of the (out, in) master
        torch.manual_seed(6)
        row = tp.RowParallelLinear(24, 16, stride=stride, keep_master_weight_for_test=True)
        torch.manual_seed(6)
        dense = torch.empty(16, 24)
        torch.nn.init.xavier_normal_(dense)
        cols = _expected_indices(24, 24 // t, stride, r, t)
        assert torch.equal(row.weight, dense[:, cols]), f"stride {stride}: row shard is not columns {cols}"
        assert (row.weight.tensor_model_parallel, row.weight.partition_dim,
                row.weight.partition_stride) == (True, 1, stride)
        shapes[f"stride{stride}"] = {"column": list(col.weight.shape), "row": list(row.weight.shape),
                                     "column_rows": rows}
    return shapes


@check
def sequence_parallel_mlp_matches_dense():
    """[s/t, b, h] -> column(sp) -> gelu -> row(sp) -> [s/t, b, h], against the dense MLP."""
    _, r, t, _ = me()
    s, b, h, ffn = 8, 2, 16, 32
    torch.manual_seed(13)
    col = tp.ColumnParallelLinear(h, ffn, gather_output=False, sequence_parallel=True,
                                  keep_master_weight_for_test=True)
    row = tp.RowParallelLinear(ffn, h, input_is_parallel=True, sequence_parallel=True,
                               keep_master_weight_for_test=True)
    x = torch.randn(s, b, h)
    block = slice(r * s // t, (r + 1) * s // t)
    x_local = x[block].clone().requires_grad_()                           # [s/t, b, h]
    y_local, _ = row(F.gelu(col(x_local)[0]))                             # [s/t, b, h]
    w1 = col.master_weight.clone().requires_grad_()
    w2 = row.master_weight.clone().requires_grad_()
    b2 = torch.zeros(h, requires_grad=True)
    x_d = x.clone().requires_grad_()
    y_d = F.linear(F.gelu(F.linear(x_d, w1)), w2, b2)                     # [s, b, h]
    errors = {"output": close(y_local, y_d[block], "output block")}
    dy = torch.randn(s, b, h)
    y_local.backward(dy[block])
    y_d.backward(dy)
    errors["input_grad"] = close(x_local.grad, x_d.grad[block], "input grad block")
    errors["w1_grad"] = close(col.weight.grad, w1.grad.chunk(t, 0)[r], "column weight grad")
    errors["w2_grad"] = close(row.weight.grad, w2.grad.chunk(t, 1)[r], "row weight grad")
    # each rank's bias gradient covers its block only: summed over the group it is the dense one
    assert row.bias.sequence_parallel is True
    bias_grad = comm.all_reduce(row.bias.grad, group=ps.get_tensor_model_parallel_group())
    errors["bias_grad_summed"] = close(bias_grad, b2.grad, "row bias grad summed over tp")
    return errors


@check
def sequence_parallel_column_keeps_only_its_block():
    """Megatron's linear: under sequence parallelism the column-parallel layer saves
    this rank's [s/t, b, h] block for backward (a saved-tensors hook counts what autograd
    keeps, parameters aside), gathers it again in backward and reduce-scatters the input
    gradient, with gradients equal to the dense layer's; with gradient-accumulation fusion the
    weight gradient goes into an fp32 ``main_grad`` instead of ``weight.grad``."""
    _, r, t, _ = me()
    s, b, h, out = 16, 2, 32, 64
    torch.manual_seed(15)
    col = tp.ColumnParallelLinear(h, out, gather_output=False, sequence_parallel=True,
                                  keep_master_weight_for_test=True)
    x = torch.randn(s, b, h)
    block = slice(r * s // t, (r + 1) * s // t)
    x_local = x[block].clone().requires_grad_()
    params = {p.data_ptr() for p in col.parameters()}
    saved = []

    def pack(tensor):
        if tensor.data_ptr() not in params:
            saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y_local, _ = col(x_local)                                            # [s, b, out/t]
    dy = torch.randn(s, b, out)
    with CollectiveLog() as backward:
        y_local.backward(dy.chunk(t, dim=-1)[r])
    w = col.master_weight.clone().requires_grad_()
    x_d = x.clone().requires_grad_()
    y_d = F.linear(x_d, w)
    y_d.backward(dy)
    errors = {"output": close(y_local, y_d.chunk(t, dim=-1)[r], "output columns"),
              "input_grad": close(x_local.grad, x_d.grad[block], "input grad block"),
              "weight_grad": close(col.weight.grad, w.grad.chunk(t, 0)[r], "weight grad")}
    fused = tp.ColumnParallelLinear(h, out, gather_output=False, sequence_parallel=True,
                                    gradient_accumulation_fusion=True)
    fused.weight.data.copy_(col.weight.data)
    fused.bias.data.copy_(col.bias.data)
    fused.weight.main_grad = torch.zeros(fused.weight.shape, dtype=torch.float32)
    for _ in range(2):       # accumulated over two micro-batches
        fused(x_local.detach())[0].backward(dy.chunk(t, dim=-1)[r])
    errors["fused_main_grad"] = close(fused.weight.main_grad, 2 * w.grad.chunk(t, 0)[r],
                                      "main_grad after two backward passes")
    return {"saved_elements": saved, "errors": errors,
            "weight_grad_is_none_when_fused": fused.weight.grad is None,
            "backward_collectives": {k: backward.count(k)
                                     for k in ("all_gather", "reduce_scatter", "all_reduce")}}


@check
def mlp_uses_one_all_reduce_each_way():
    """Megatron-LM §3: the column -> row MLP needs one all-reduce forward (g), one backward (f)."""
    torch.manual_seed(14)
    col = tp.ColumnParallelLinear(16, 32, gather_output=False)
    row = tp.RowParallelLinear(32, 16, input_is_parallel=True)
    x = torch.randn(3, 16, requires_grad=True)
    with CollectiveLog() as fwd:
        y, _ = row(F.gelu(col(x)[0]))
    with CollectiveLog() as bwd:
        y.sum().backward()
    counts = {"forward": fwd.count(), "forward_all_reduce": fwd.count("all_reduce"),
              "backward": bwd.count(), "backward_all_reduce": bwd.count("all_reduce")}
    assert counts == {"forward": 1, "forward_all_reduce": 1, "backward": 1,
                      "backward_all_reduce": 1}, counts
    return counts


@check
def vocab_parallel_cross_entropy_matches_dense():
    _, r, t, _ = me()
    vocab, s, b = 64, 6, 3
    torch.manual_seed(21)
    logits = torch.randn(s, b, vocab) * 2                                 # full logits, every rank
    target = torch.randint(0, vocab, (s, b))
    dloss = torch.rand(s, b)
    errors = {}
    for smoothing in (0.0, 0.1):
        mine = tp.split_tensor_along_last_dim(logits, t)[r].clone().requires_grad_()  # [s, b, V/t]
        loss = tp.vocab_parallel_cross_entropy(mine, target, label_smoothing=smoothing)
        full = logits.clone().requires_grad_()
        ref = F.cross_entropy(full.view(-1, vocab), target.view(-1), reduction="none",
                              label_smoothing=smoothing).view_as(target)
        assert loss.shape == target.shape
        errors[f"loss_ls{smoothing}"] = close(loss, ref, f"loss, label_smoothing={smoothing}")
        (loss * dloss).sum().backward()
        (ref * dloss).sum().backward()
        errors[f"grad_ls{smoothing}"] = close(mine.grad, full.grad.chunk(t, -1)[r],
                                              f"logits grad, label_smoothing={smoothing}")
    return errors


@check
def vocab_parallel_embedding_matches_dense():
    _, r, t, _ = me()
    vocab, h = 32, 8
    torch.manual_seed(17)
    emb = tp.VocabParallelEmbedding(vocab, h, keep_master_weight_for_test=True)
    ids = torch.randint(0, vocab, (5, 3))
    out = emb(ids)
    w = emb.master_weight.clone().requires_grad_()
    ref = F.embedding(ids, w)
    assert torch.equal(out, ref), "embedding output differs from F.embedding"
    start, end = emb.vocab_start_index, emb.vocab_end_index
    assert torch.equal(emb.weight, w.detach()[start:end])
    dy = torch.randn(5, 3, h)
    out.backward(dy)
    ref.backward(dy)
    err = close(emb.weight.grad, w.grad[start:end], "weight grad rows")
    return {"rows": [start, end], "weight_grad": err}


@check
def rng_tracker_forks_per_tp_rank():
    _, r, t, _ = me()
    seed = 1234
    tp.model_parallel_manual_seed(seed)
    x = torch.ones(256)
    before = F.dropout(x, 0.5)
    with tp.get_rng_tracker().fork():
        inside = F.dropout(x, 0.5)
    after = F.dropout(x, 0.5)
    masks = gather_tp(torch.stack([before, inside, after]))                # [t, 3, 256]
    for q in range(1, t):
        assert torch.equal(masks[q, 0], masks[0, 0]), "dropout outside fork differs across tp ranks"
        assert torch.equal(masks[q, 2], masks[0, 2]), "dropout after fork differs across tp ranks"
        assert not torch.equal(masks[q, 1], masks[0, 1]), "dropout inside fork is the same on tp ranks"
    # ranks with the same tp rank (one pipeline group) draw the same mask inside fork
    same_tp_rank = comm.all_gather(inside.unsqueeze(0), group=ps.get_pipeline_model_parallel_group())
    assert all(torch.equal(m, inside) for m in same_tp_rank)
    # the streams are what the seeds say: default = seed, fork = seed + 2718 + tp rank
    torch.manual_seed(seed)
    assert torch.equal(F.dropout(x, 0.5), before)
    assert torch.equal(F.dropout(x, 0.5), after), "fork disturbed the default stream"
    torch.manual_seed(seed + 2718 + r)
    assert torch.equal(F.dropout(x, 0.5), inside)
    return {"kept_inside": int(inside.count_nonzero()), "kept_outside": int(before.count_nonzero())}


# --------------------------------------------------------------------------- driver
def run_checks():
    results = {}
    for tp_size, pp_size in LAYOUTS:
        ps.initialize_model_parallel(tp_size, pp_size)
        for fn in CHECKS:
            name = f"tp{tp_size}-pp{pp_size}/{fn.__name__}"
            try:
                results[name] = {"ok": True, "values": fn()}
            except AssertionError as exc:
                last = traceback.extract_tb(exc.__traceback__)[-1]
                results[name] = {"ok": False, "error": f"{exc} (line {last.lineno})"}
        ps.destroy_model_parallel()
    return results


@launcher.entrypoint
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-going", action="store_true",
                        help="exit 0 even if a check failed (the test reads each check's result)")
    args = parser.parse_args()
    initialize.init()
    # The checks build their tensors with plain factories: put them on this rank's device
    # (the CPU in CI; a GPU shared through gloo, or one per rank with NCCL, elsewhere).
    torch.set_default_device(initialize.get_device())
    results = run_checks()
    launcher.report({"rank": dist.get_rank(), "checks": results})
    failed = torch.tensor([sum(not v["ok"] for v in results.values())])
    failed_per_rank = comm.all_gather(failed)
    if dist.get_rank() == 0:
        for name, value in results.items():
            print(f"{'ok  ' if value['ok'] else 'FAIL'} {name}")
        print(f"failed checks per rank: {failed_per_rank.tolist()}")
    initialize.shutdown()
    if failed_per_rank.sum().item() and not args.keep_going:
        sys.exit(1)


if __name__ == "__main__":
    main()
