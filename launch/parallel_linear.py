"""Column- and row-parallel linear layers against the dense matmul they replace.

    torchrun --standalone --nproc-per-node 4 launch/parallel_linear.py --tp 4

In the MPU walkthrough's notation ``Y = X A`` with ``A`` of shape ``(input_size,
output_size)`` = (1024, 512). Column parallel splits ``A`` along its columns into ``A_0 ...
A_{t-1}`` of shape (1024, 512/t); row parallel splits it along its rows into (1024/t, 512)
pieces. The split is over the *tensor-parallel* size ``t`` (the walkthrough's code slices by
the world size, 16 — a slip). Every rank builds the same master weight from ``--seed``, keeps
its slice, and compares forward output, input gradient and weight gradient with a dense
``F.linear`` on the master weight. ``--stride 3`` splits a fused weight (as ``[Q; K; V]``):
rank ``i`` keeps the ``i``-th slice of each of the 3 blocks.

From a notebook: ``mpu_lab.launcher.run("parallel_linear.py", ["--tp", "4"], nproc=4).results``.
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpu_lab.training import flag_errors, initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state as ps
from mpu_lab.core import tensor_parallel as tp

TOL = 1e-6


gather_lines = launcher.gather_lines  # rank-ordered output, shared with the other scripts


def shard_indices(size, t, r, stride):
    """Rows (column parallel) or columns (row parallel) of the master that rank r of t keeps:
    pieces of ``size / (t * stride)``, every t-th piece starting at r."""
    piece = size // (t * stride)
    return [p * piece + j for p in range(r, t * stride, t) for j in range(piece)]


def error(actual, expected):
    """max|actual - expected| / max(1, max|expected|): absolute up to 1, relative above."""
    err = (actual - expected).abs().max().item()
    return err / max(1.0, expected.abs().max().item())


def run_layer(kind, args):
    """Build the ``kind`` ("column"/"row") layer and its dense twin; compare; return results."""
    t, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    device = initialize.get_device()
    torch.manual_seed(args.seed)                      # the same master weight on every rank
    if kind == "column":
        layer = tp.ColumnParallelLinear(args.input_size, args.output_size, stride=args.stride,
                                        keep_master_weight_for_test=True)
    else:
        layer = tp.RowParallelLinear(args.input_size, args.output_size, stride=args.stride,
                                     keep_master_weight_for_test=True)
    master = layer.master_weight.to(device)            # (output_size, input_size) = A^T
    torch.manual_seed(args.seed + 1)                  # the same batch on every rank
    # Drawn on the CPU under the default generator (the same numbers on every rank and
    # device, like the master weight), then moved to the rank's device.
    x = torch.randn(args.batch, args.input_size).to(device)     # cpu: seeded, moved
    dy = torch.randn(args.batch, args.output_size).to(device)   # cpu: seeded, moved

    # The tensor-parallel layer: forward and backward.
    x_tp = x.clone().requires_grad_()
    y, _ = layer(x_tp)                                # [batch, output_size]
    y.backward(dy)

    # The dense twin: F.linear with the full master weight (the layer's bias is zero).
    w = master.clone().requires_grad_()
    x_d = x.clone().requires_grad_()
    size = args.output_size if kind == "column" else args.input_size
    # With stride > 1 the ranks' slices, laid side by side, are the master's rows (columns)
    # in this order: the gathered column output comes out in it, and a row layer's input
    # features are read in it (as a strided column layer without gather hands them over).
    order = sum((shard_indices(size, t, q, args.stride) for q in range(t)), [])
    if kind == "column":
        y_d = F.linear(x_d, w, torch.zeros(args.output_size, device=device))[:, order]
    else:
        y_d = F.linear(x_d, w[:, order], torch.zeros(args.output_size, device=device))
    y_d.backward(dy)

    if kind == "column":
        keep = shard_indices(args.output_size, t, r, args.stride)
        dense_grad_slice = w.grad[keep]                               # (out/t, in)
        a_shape = tuple(layer.weight.t().shape)                       # A_i = (in, out/t)
    else:
        keep = shard_indices(args.input_size, t, r, args.stride)
        dense_grad_slice = w.grad[:, keep]                            # (out, in/t)
        a_shape = tuple(layer.weight.t().shape)                       # A_i = (in/t, out)
    shard_is_slice = torch.equal(layer.weight.detach(), master[keep] if kind == "column"
                                 else master[:, keep])
    res = {
        "tp_rank": r,
        "A_shape": list(a_shape),
        "weight_shape": list(layer.weight.shape),
        "shard_is_master_slice": shard_is_slice,
        "output_bit_exact": torch.equal(y, y_d),
        "output_error": error(y, y_d),
        "input_grad_error": error(x_tp.grad, x_d.grad),
        "weight_grad_error": error(layer.weight.grad, dense_grad_slice),
    }
    assert shard_is_slice, f"{kind}: the shard is not rows/columns {keep[:4]}... of the master"
    worst = max(res["output_error"], res["input_grad_error"], res["weight_grad_error"])
    assert worst <= TOL, f"{kind}: error {worst:.3g} > {TOL:g}: {res}"
    return res


def describe(kind, res, args, t):
    """Rank 0 prints A = [A0= ..., A1= ...] as the MPU walkthrough does, then per-rank errors."""
    lines = gather_lines(
        f"rank {dist.get_rank()} (tp rank {res['tp_rank']}): A{res['tp_rank']}= "
        f"torch.Size({res['A_shape']})  weight {tuple(res['weight_shape'])}  "
        f"output {'bit-exact' if res['output_bit_exact'] else 'error %.1e' % res['output_error']}, "
        f"input grad error {res['input_grad_error']:.1e}, "
        f"weight grad error {res['weight_grad_error']:.1e}")
    if lines is None:
        return
    how = "columns" if kind == "column" else "rows"
    print(f"\n{kind} parallel: A ({args.input_size} x {args.output_size}) split along its {how} "
          f"into tp={t} pieces (stride {args.stride})")
    pieces = [f"A{i}= torch.Size({res['A_shape']})" for i in range(t)]
    print("A = [\n" + ",".join(pieces) + "\n ]")
    print("\n".join(lines))


@launcher.entrypoint
def main():
    parser = flag_errors.ArgumentParser(description="column/row parallel linear vs dense matmul")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel size (default: the world size)")
    parser.add_argument("--input-size", type=int, default=1024)
    parser.add_argument("--output-size", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    t = args.tp or world
    if world % t:
        parser.error(f"--tp {t} does not divide the world of {world} ranks")
    for name, size in (("--output-size", args.output_size), ("--input-size", args.input_size)):
        if size % (t * args.stride):
            parser.error(f"{name} {size} is not divisible by tp x stride = {t} x {args.stride}")

    initialize.init()
    ps.initialize_model_parallel(tensor_model_parallel_size=t)
    results = {}
    for kind in ("column", "row"):
        results[kind] = run_layer(kind, args)
        describe(kind, results[kind], args, t)
    launcher.report({"rank": dist.get_rank(), "tp": t, **results})
    if dist.get_rank() == 0:
        print(f"\nall {world} ranks: shards are slices of the master weight; forward and "
              f"gradients match the dense matmul within {TOL:g} (error = max|diff| / "
              f"max(1, max|dense|))")
    initialize.shutdown()


if __name__ == "__main__":
    main()
