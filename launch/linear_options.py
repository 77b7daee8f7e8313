"""The options of the parallel linear layers, each checked against the dense layer (labs 06/07).

    torchrun --standalone --nproc-per-node 2 --tee 3 launch/linear_options.py --layer column
    torchrun --standalone --nproc-per-node 2 --tee 3 launch/linear_options.py --layer row mlp

From a notebook: ``mpu_lab.launcher.run("linear_options.py", ["--layer", "column"], nproc=2)``.

For every variant (``gather_output``, ``skip_bias_add``, a fused weight with ``stride``;
``input_is_parallel``; the MLP pair of Megatron-LM §3) each rank builds the layer from the
same master weight (``torch.manual_seed``), runs forward and backward on ``--steps`` random
batches, and compares output, input gradient and weight gradient with the dense layer
``F.linear(x, W, b)`` on the master weight (tolerance 1e-6, relative above 1). It counts the
collectives each pass issues, from outside (torch's ``CommDebugMode``:
:class:`mpu_lab.perf.comm_counts.CollectiveLog`), and prints one line per variant:
shapes, counts and the verdict, nothing machine-dependent. Results go to
:func:`mpu_lab.launcher.report`.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpu_lab.training import flag_errors, initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state as ps
from mpu_lab.core import tensor_parallel as tp
from mpu_lab.perf.comm_counts import CollectiveLog

TOL = 1e-6


def close(actual, expected):
    """max|actual - expected| <= TOL * max(1, max|expected|)."""
    return (actual - expected).abs().max().item() <= TOL * max(1.0, expected.abs().max().item())


def kept(size, t, r, stride=1):
    """Master rows (column layer) / columns (row layer) that tensor-parallel rank r keeps:
    pieces of size / (t * stride), every t-th piece starting at piece r (Megatron's split)."""
    piece = size // (t * stride)
    return [p * piece + j for p in range(r, t * stride, t) for j in range(piece)]


def counts(counter):
    """``{"all_reduce": 1, ...}`` of one pass, sorted by name."""
    found = {}
    for event in counter.events:
        found[event["kind"]] = found.get(event["kind"], 0) + 1
    return dict(sorted(found.items()))


def seeded(shape, seed, device):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device)   # cpu: seeded CPU draw, then moved


def column_case(args, name, step, gather_output=True, skip_bias_add=False, stride=1):
    t, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dev = initialize.get_device()
    out_size = args.output_size * stride                 # a weight of `stride` parts stored one after another ([W_gate; W_up]: 2) is stride x wider
    torch.manual_seed(args.seed + step)                  # same master weight on every rank
    layer = tp.ColumnParallelLinear(args.input_size, out_size, gather_output=gather_output,
                                    skip_bias_add=skip_bias_add, stride=stride,
                                    keep_master_weight_for_test=True)
    rows = kept(out_size, t, r, stride)
    bias = seeded((out_size,), args.seed + 100 + step, dev)  # a non-zero bias, to see it move
    with torch.no_grad():
        layer.bias.copy_(bias[rows])
    w = layer.master_weight.to(dev).requires_grad_()    # [out, in] = A^T
    x = seeded((args.batch, args.input_size), args.seed + 200 + step, dev)
    dy = seeded((args.batch, out_size), args.seed + 300 + step, dev)

    x_tp = x.clone().requires_grad_()
    with CollectiveLog() as fwd:
        y, returned_bias = layer(x_tp)                  # [b, out] or this rank's [b, out/t]
    total = y + returned_bias if skip_bias_add else y
    local_dy = dy if gather_output else dy[:, rows]
    with CollectiveLog() as bwd:
        total.backward(local_dy)

    x_d = x.clone().requires_grad_()
    y_d = F.linear(x_d, w, bias)                        # the dense layer, [b, out]
    y_d.backward(dy)
    expected = y_d if gather_output else y_d[:, rows]
    ok = (close(total, expected) and close(x_tp.grad, x_d.grad)
          and close(layer.weight.grad, w.grad[rows]))
    extra = {}
    if skip_bias_add:
        extra["returned_bias_shape"] = list(returned_bias.shape)
    if stride > 1:
        piece = out_size // (t * stride)
        extra["row_blocks"] = [[rows[i], rows[i + piece - 1]] for i in range(0, len(rows), piece)]
    return dict(layer="column", name=name, output_shape=list(y.shape),
                weight_shape=list(layer.weight.shape), forward=counts(fwd), backward=counts(bwd),
                matches_dense=ok, **extra)


def row_case(args, name, step, input_is_parallel=False, skip_bias_add=False):
    t, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dev = initialize.get_device()
    torch.manual_seed(args.seed + step)
    layer = tp.RowParallelLinear(args.input_size, args.output_size,
                                 input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add,
                                 keep_master_weight_for_test=True)
    cols = kept(args.input_size, t, r)
    bias = seeded((args.output_size,), args.seed + 100 + step, dev)
    with torch.no_grad():
        layer.bias.copy_(bias)                          # not split: added once, after g
    w = layer.master_weight.to(dev).requires_grad_()    # [out, in]
    x = seeded((args.batch, args.input_size), args.seed + 200 + step, dev)
    dy = seeded((args.batch, args.output_size), args.seed + 300 + step, dev)

    x_tp = (x[:, cols] if input_is_parallel else x).clone().requires_grad_()
    with CollectiveLog() as fwd:
        y, returned_bias = layer(x_tp)                  # [b, out] on every rank
    total = y + returned_bias if skip_bias_add else y
    with CollectiveLog() as bwd:
        total.backward(dy)

    x_d = x.clone().requires_grad_()
    y_d = F.linear(x_d, w, bias)
    y_d.backward(dy)
    x_grad = x_d.grad[:, cols] if input_is_parallel else x_d.grad
    ok = close(total, y_d) and close(x_tp.grad, x_grad) and close(layer.weight.grad, w.grad[:, cols])
    extra = {"input_shape": list(x_tp.shape)}
    if skip_bias_add:
        extra["returned_bias_shape"] = list(returned_bias.shape)
    return dict(layer="row", name=name, output_shape=list(y.shape),
                weight_shape=list(layer.weight.shape), forward=counts(fwd), backward=counts(bwd),
                matches_dense=ok, **extra)


def mlp_case(args, name, step):
    """Z = GeLU(X A) B with A column-parallel (no gather) and B row-parallel (input parallel)."""
    t, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dev = initialize.get_device()
    h, ffn = args.output_size, args.input_size          # e.g. h=512, ffn=1024 (4h in a GPT)
    torch.manual_seed(args.seed + step)
    fc1 = tp.ColumnParallelLinear(h, ffn, gather_output=False, keep_master_weight_for_test=True)
    fc2 = tp.RowParallelLinear(ffn, h, input_is_parallel=True, keep_master_weight_for_test=True)
    w1 = fc1.master_weight.to(dev).requires_grad_()     # [ffn, h]
    w2 = fc2.master_weight.to(dev).requires_grad_()     # [h, ffn]
    x = seeded((args.batch, h), args.seed + 200 + step, dev)
    dz = seeded((args.batch, h), args.seed + 300 + step, dev)

    x_tp = x.clone().requires_grad_()
    with CollectiveLog() as fwd:
        z, _ = fc2(F.gelu(fc1(x_tp)[0]))                # f ... g
    with CollectiveLog() as bwd:
        z.backward(dz)

    x_d = x.clone().requires_grad_()
    z_d = F.linear(F.gelu(F.linear(x_d, w1)), w2)       # biases are zero in both
    z_d.backward(dz)
    part = kept(ffn, t, r)
    ok = (close(z, z_d) and close(x_tp.grad, x_d.grad) and close(fc1.weight.grad, w1.grad[part])
          and close(fc2.weight.grad, w2.grad[:, part]))
    return dict(layer="mlp", name=name, output_shape=list(z.shape),
                weight_shape=[list(fc1.weight.shape), list(fc2.weight.shape)],
                forward=counts(fwd), backward=counts(bwd), matches_dense=ok)


def cases(layers, stride):
    if "column" in layers:
        yield column_case, "gather_output=True", {}
        yield column_case, "gather_output=False", dict(gather_output=False)
        yield column_case, "skip_bias_add=True", dict(gather_output=False, skip_bias_add=True)
        yield column_case, f"stride={stride} (fused)", dict(gather_output=False, stride=stride)
    if "row" in layers:
        yield row_case, "input_is_parallel=False", {}
        yield row_case, "input_is_parallel=True", dict(input_is_parallel=True)
        yield row_case, "skip_bias_add=True", dict(input_is_parallel=True, skip_bias_add=True)
    if "mlp" in layers:
        yield mlp_case, "column(gather_output=False) -> GeLU -> row(input_is_parallel=True)", {}


def line(res):
    def show(c):
        return ", ".join(f"{n} {k}" for k, n in c.items()) or "none"
    extra = ""
    if "returned_bias_shape" in res:
        extra += f", bias returned {res['returned_bias_shape']}"
    if "input_shape" in res:
        extra += f", input {res['input_shape']}"
    if "row_blocks" in res:
        extra += ", keeps master rows " + " ".join(f"{a}-{b}" for a, b in res["row_blocks"])
    return (f"{res['layer']} {res['name']}: output {res['output_shape']}{extra} | forward: "
            f"{show(res['forward'])} | backward: {show(res['backward'])} | matches dense: "
            f"{res['matches_dense']}")


@launcher.entrypoint
def main(argv=None):
    parser = flag_errors.ArgumentParser(description="parallel linear options vs the dense layer")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: world)")
    parser.add_argument("--layer", nargs="+", choices=["column", "row", "mlp"], default=["column"])
    parser.add_argument("--input-size", type=int, default=1024)
    parser.add_argument("--output-size", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--stride", type=int, default=3, help="parts stored one after another (2 for a SwiGLU [W_gate; W_up]; 3 for the 2019 [Q; K; V])")
    parser.add_argument("--steps", type=int, default=1, help="random batches per variant")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    initialize.init()   # backend: MPU_LAB_BACKEND (auto, gloo, nccl)
    t = args.tp or dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=t)
    results = []
    for fn, name, kwargs in cases(args.layer, args.stride):
        steps = [fn(args, name, step, **kwargs) for step in range(args.steps)]
        res = dict(steps[0], matches_dense=all(s["matches_dense"] for s in steps), steps=args.steps)
        print(line(res))   # mpu_lab.launcher (or torchrun --tee 3) prefixes the rank
        results.append(res)
    launcher.report({"rank": dist.get_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
                   "tp": t, "cases": results})
    bad = [r["name"] for r in results if not r["matches_dense"]]
    if bad:
        raise AssertionError(f"rank {dist.get_rank()}: {bad} differ from the dense layer")
    initialize.shutdown()


if __name__ == "__main__":
    main()
