"""Benchmark: time, algbw and busbw of the collectives over message sizes, as nccl-tests does.

    torchrun --standalone --nproc-per-node 4 launch/bench_bandwidth.py
    torchrun --standalone --nproc-per-node 8 launch/bench_bandwidth.py \
        --ops all_reduce all_gather --min-bytes 1M --max-bytes 1G --iters 20 --dtype bfloat16

From a notebook: ``mpu_lab.launcher.run("bench_bandwidth.py", [...], nproc=4).results[0]["rows"]``
and ``mpu_lab.perf.bandwidth.format_bandwidth(rows)``.

Every call goes through :mod:`mpu_lab.core.comm`, the functions the model uses, so the times include
what they add (a fresh output tensor per call; on gloo with CUDA tensors, the copy through host
memory). Per op and size ``S`` (the whole array, nccl-tests' convention): ``warmup`` untimed
calls, then ``iters`` timed ones between two synchronisations; each rank's mean time is
averaged over the ranks (nccl-tests' default ``-a 1``); ``algbw = S / t`` and
``busbw = algbw x factor`` with the factors of nccl-tests' doc/PERFORMANCE.md
(:func:`mpu_lab.perf.bandwidth.busbw`). The first call of each size is checked against the
expected values (the ``wrong`` count must be 0). A benchmark that prints figures, not a test.
"""
import argparse
import sys
import time

import torch
import torch.distributed as dist

from mpu_lab.core import comm
from mpu_lab.training import flag_errors, initialize
from mpu_lab import launcher
from mpu_lab.perf import bandwidth

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv):
    p = flag_errors.ArgumentParser(prog="bench_bandwidth.py", description=__doc__.split("\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ops", nargs="+", default=list(bandwidth.COLLECTIVES),
                   help=f"collectives to time, of {', '.join(bandwidth.COLLECTIVES)}")
    p.add_argument("--min-bytes", default="4K", help="smallest whole-array size S (e.g. 1K)")
    p.add_argument("--max-bytes", default="4M", help="largest S (e.g. 64M, 1G)")
    p.add_argument("--factor", type=int, default=4, help="size multiplier from one row to the next")
    p.add_argument("--iters", type=int, default=10, help="timed calls per size")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per size first")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = p.parse_args(argv)
    for op in args.ops:
        if op not in bandwidth.COLLECTIVES:
            p.error(f"--ops: unknown collective {op!r}; valid: {', '.join(bandwidth.COLLECTIVES)}")
    if args.iters < 1 or args.warmup < 0:
        p.error(f"--iters ({args.iters}) must be >= 1 and --warmup ({args.warmup}) >= 0")
    try:
        args.sizes = bandwidth.message_sizes(args.min_bytes, args.max_bytes, args.factor)
    except ValueError as exc:
        p.error(str(exc))
    return args


def call(op, x):
    if op == "all_reduce":
        return comm.all_reduce(x)
    if op == "all_gather":
        return comm.all_gather(x)
    if op == "reduce_scatter":
        return comm.reduce_scatter(x)
    return comm.broadcast(x, src=0)


def expected(op, numel, n, rank, dtype, device):
    """The result of ``call(op, x)`` when rank r's input is all (r + 1)."""
    if op == "all_reduce" or op == "reduce_scatter":
        size = numel if op == "all_reduce" else numel // n
        return torch.full((size,), n * (n + 1) / 2, dtype=dtype, device=device)
    if op == "all_gather":
        return torch.cat([torch.full((numel,), r + 1.0, dtype=dtype, device=device)
                          for r in range(n)])
    return torch.full((numel,), 1.0, dtype=dtype, device=device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(op, size, args, info):
    n, dtype, device = info.world_size, DTYPES[args.dtype], info.device
    element_size = torch.empty((), dtype=dtype, device=device).element_size()
    numel, whole = bandwidth.collective_numel(op, size, n, element_size)
    x = torch.full((numel,), info.rank + 1.0, dtype=dtype, device=device)
    wrong = int(not torch.equal(call(op, x), expected(op, numel, n, info.rank, dtype, device)))
    for _ in range(args.warmup):
        call(op, x)
    dist.barrier()
    sync(device)
    start = time.perf_counter()
    for _ in range(args.iters):
        call(op, x)
    sync(device)
    mine = (time.perf_counter() - start) / args.iters
    totals = comm.all_reduce(torch.tensor([mine, wrong], dtype=torch.float64, device=device))
    t = float(totals[0]) / n
    return dict(op=op, size_bytes=whole, ranks=n, dtype=args.dtype, time_s=t,
                algbw=bandwidth.algbw(whole, t), busbw=bandwidth.busbw(op, whole, t, n),
                wrong=int(totals[1]))


@launcher.entrypoint
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    info = initialize.init()
    rows = [bench(op, size, args, info) for op in args.ops for size in args.sizes]
    if info.rank == 0:
        print(f"# {info.world_size} ranks, backend {info.backend}, device {info.device.type}, "
              f"{args.dtype}, {args.iters} timed calls per size after {args.warmup} warm-up")
        print(bandwidth.format_bandwidth(rows))
        print(f"# wrong results: {sum(r['wrong'] for r in rows)}")
    launcher.report(dict(rows=rows, world_size=info.world_size, backend=info.backend,
                       device=str(info.device), dtype=args.dtype, iters=args.iters))
    initialize.shutdown()


if __name__ == "__main__":
    main()
