"""Benchmark: the analytic cost model's predicted step time vs a real train_gpt.py run, on this CPU.

    python launch/bench_cost_model.py                      # 3 configurations, about a minute
    python launch/bench_cost_model.py --configs tp2 dp2 --hidden-size 256 --iters 16
    python launch/bench_cost_model.py --published          # also the published-runs fit

    # the calibration job it starts (every rank times matmuls, memory and an all-reduce):
    torchrun --standalone --nproc-per-node 2 launch/bench_cost_model.py --worker

Run plainly it is a driver that starts its own torchrun jobs through mpu_lab.launcher.run.

Steps:

1. Calibrate this machine before and after the runs of each rank count (averaged; the drift
   between the two is printed): the FLOP/s of the model's own layer GEMMs at
   the thread count each rank gets (mpu_lab.launcher gives each of n ranks cores/n threads), the
   memory bandwidth of an elementwise add, and the latency (a small all-reduce right after a
   matmul, as in a layer) and bus bandwidth (4 MiB) of a gloo all-reduce, all in one torchrun
   job whose ranks measure at the same time.
2. Run each small train_gpt.py configuration (mock data, fp32) and take the fastest
   ``iteration_time_s`` of its --metrics-file after the warm-up iterations (the median is
   printed too). Calibration and measurement both take the fastest of several tries: on a
   shared machine the slow ones measure the other processes. "CPU contended" is the share of
   the run during which some task waited for a CPU (Linux pressure-stall information,
   /proc/pressure/cpu): our ranks fit the cores, so anything well above 0 is other processes,
   and the ratio then says more about them than about the model.
3. Measure each configuration's host overhead: the same run at a tiny width (hidden size 2 per
   head), where the matmuls, element-wise ops and transfers vanish and what is left is Python,
   the autograd engine, op dispatch and the small collectives the model has no term for (the
   gradient norm's, the loss log's, the tensor-parallel data broadcast). Its fastest step minus
   the model's prediction for it is the model's ``framework`` term
   (mpu_lab.perf.calibrate.host_overhead).
4. Predict the same configuration with mpu_lab.perf.cost_model.predict_iteration on the
   calibrated cluster and print measured, predicted and their ratio. Target: within ±20 %.
5. With ``--terms``, run each configuration once more under torch.profiler and set the
   profile's op classes (matmul, non-matmul, communication, optimizer, framework:
   mpu_lab.perf.op_classes) against the model's terms, one table per configuration.
   With ``--markdown FILE`` the table of step 4 is also written as markdown, headed by the
   command and the date, for docs/BENCHMARKS.md to include verbatim.

What the profiles found (2-core AMD EPYC, 2026-11-23): the layer GEMMs run at the calibrated
rate (76-86 GFLOP/s per rank, forward and both backward GEMMs alike) and a layer's element-wise
ops at the calibrated bandwidth; the prediction fell short by a steady 8-21 % because a step
also holds ~2,300-3,400 dispatched ops per rank (15-25 ms of autograd engine, custom
``Function`` and Python time between ops) and, with data parallelism, DDP's copies of the
gradients into its buckets and back (``aten::copy_``). The tiny-width run measures the first;
the copies stay unmodelled (a few per cent at DP=2). Timings on a shared machine are noisy:
run it when the machine is quiet, and read the ratio, not the digits. Every synchronisation
point (a TP layer has several per step) also absorbs the other processes' scheduling jitter,
so TP suffers most from a busy machine; hidden size 512 (the default) keeps the matmuls long
against it.

The model's pipeline term is Megatron's 1F1B, (m + p - 1) micro-batch times. An earlier
mpu_lab schedule received a steady-state step's backward gradient before running its forward,
so stage 0 began forward 1 only after stage 1 had finished backward 0 (4 instead of 3 (f + b)
units at p = 2, m = 2, measured 1.26-1.36x the prediction); this benchmark found it, and
mpu_lab.perf.pipeline_order now communicates after every op of plain 1F1B, as Megatron does.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from mpu_lab.core import comm
from mpu_lab.training import initialize
from mpu_lab import launcher
from mpu_lab.perf import calibrate, op_classes, published_runs
from mpu_lab.perf.calibrate import TrainConfig
from mpu_lab.perf.calibrate_gpu import device_best_time
from mpu_lab.perf.cost_model import ring_all_reduce_factor

# Two ranks each (one thread each on a 2-core machine): a single rank with two OpenMP threads
# slows down erratically when other processes share the cores (spinning thread barriers).
CONFIGS = {
    "tp1": dict(tp=1),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2, num_layers=4, global_batch_size=16),
    "dp2": dict(dp=2, global_batch_size=16),
    "tp2sp": dict(tp=2, sequence_parallel=True),
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench_cost_model.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--worker", action="store_true",
                   help="run as the torchrun calibration job (mpu_lab.perf.calibrate.calibrate_ranks)")
    p.add_argument("--shape-sets", default=None,
                   help="--worker: JSON list of sets of [batch, m, k, n] matmuls to time")
    p.add_argument("--configs", nargs="+", default=["tp2", "pp2", "dp2"],
                   help=f"which configurations, of {', '.join(CONFIGS)}")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--iters", type=int, default=10, help="train iterations per run (4 warm-up)")
    p.add_argument("--tries", type=int, default=2,
                   help="run each configuration (and its tiny-width twin) this many times and "
                        "keep the fastest: a run a passing disturbance slowed as a whole, which "
                        "happens on a shared machine, does not count")
    p.add_argument("--attempts", type=int, default=1,
                   help="re-run a configuration whose run was CPU-contended (pressure > 10 %%), "
                        "up to this many times, and keep the least contended run")
    p.add_argument("--published", action="store_true",
                   help="also print the published-runs comparison (no measurement)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--markdown", default=None, metavar="FILE",
                   help="also write the table as markdown (with the command and the date) to "
                        "FILE, for docs/BENCHMARKS.md to include verbatim: between its markers "
                        f"{MARKERS[0]!r} and {MARKERS[1]!r} where FILE has them")
    p.add_argument("--terms", action="store_true",
                   help="also profile each configuration once and print the model's terms "
                        "against the profile's op classes")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to this long for the CPU to be mostly idle (a shared "
                        "machine); then run anyway")
    args = p.parse_args(argv)
    for name in args.configs:
        if name not in CONFIGS:
            p.error(f"--configs: unknown {name!r}; valid: {', '.join(CONFIGS)}")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.attempts < 1:
        p.error(f"--attempts must be >= 1, got {args.attempts}")
    if args.tries < 1:
        p.error(f"--tries must be >= 1, got {args.tries}")
    if args.iters < 6:
        p.error(f"--iters must be >= 6 (4 are warm-up), got {args.iters}")
    if args.hidden_size % args.num_attention_heads:
        p.error(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                f"{args.num_attention_heads}")
    return args


def build_configs(args):
    out = []
    for name in args.configs:
        base = dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                    num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size,
                    global_batch_size=args.micro_batch_size, train_iters=args.iters)
        base.update(CONFIGS[name])
        if "global_batch_size" in CONFIGS[name]:
            # keep the ratio B / b of the preset (micro-batches per pipeline) at any b
            base["global_batch_size"] = CONFIGS[name]["global_batch_size"] * \
                args.micro_batch_size // 8
        out.append(TrainConfig(**base))
    return out


@launcher.entrypoint
def worker(args):
    """One rank of the calibration job: all ranks time at the same moment, as in training."""
    info = initialize.init(backend="gloo", device="cpu")
    sets = json.loads(args.shape_sets) if args.shape_sets else [[[1, 1024, 256, 1024]]]
    dist.barrier()
    rates = [calibrate.calibrate_matmul([tuple(x) for x in shapes]) for shapes in sets]
    out = dict(rank=info.rank, threads=torch.get_num_threads(), matmul_flops_sets=rates,
               memory_bandwidth=calibrate.calibrate_memory_bandwidth())
    if info.world_size > 1:
        # latency: a 4 KiB all-reduce right after a matmul, as in a layer (back-to-back calls
        # keep gloo's I/O thread awake and understate it); bandwidth: 4 MiB back-to-back
        dev = info.device                 # the CPU: this job calibrates the CPU (init above)
        a, b = torch.randn(1024, 256, device=dev), torch.randn(256, 1024, device=dev)
        small, big = torch.ones(1024, device=dev), torch.ones(1 << 20, device=dev)
        alone = device_best_time(lambda: a @ b, dev, 20, warmup=2)
        after = device_best_time(lambda: (a @ b, comm.all_reduce(small)), dev, 20, warmup=2)
        t_small = device_best_time(lambda: comm.all_reduce(small), dev, 10, warmup=2)
        t_big = device_best_time(lambda: comm.all_reduce(big), dev, 10, warmup=2)
        out["latency_s"] = max(after - alone, t_small)
        out["busbw"] = ring_all_reduce_factor(info.world_size) * (4 << 20) / max(
            t_big - t_small, 1e-9)
    launcher.report(out)
    initialize.shutdown()


def wait_quiet(limit_s, busy_below=25.0):
    """Sample the CPU every 2 s until less than ``busy_below`` % of it is in use (or the time
    is up); returns the last sample."""
    import psutil
    end = time.monotonic() + limit_s
    busy = psutil.cpu_percent(interval=2)
    while busy >= busy_below and time.monotonic() < end:
        busy = psutil.cpu_percent(interval=2)
    return busy


def markdown_table(rows, argv, worst, elapsed_s) -> str:
    """The measured-vs-predicted table as markdown, headed by the command, the date and the
    machine (what docs/BENCHMARKS.md includes verbatim)."""
    import platform
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    command = " ".join(["python launch/bench_cost_model.py"] + list(argv))
    lines = [f"`{command}`, {time.strftime('%Y-%m-%d', time.gmtime())}, "
             f"{os.cpu_count()} CPU cores ({cpu}), "
             f"torch {torch.__version__}, {elapsed_s:.0f} s:", "",
             "| configuration | measured s/step | predicted | of which framework | ratio "
             "| CPU contended |", "|---|---|---|---|---|---|"]
    for r in rows:
        pressure = "?" if r.get("cpu_pressure") is None else f"{r['cpu_pressure']:.0%}"
        lines.append(f"| {r['config']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} | "
                     f"{r['host_overhead_s']:.3f} | {r['ratio']:.2f} | {pressure} |")
    lines += ["", f"Worst |measured/predicted − 1|: {worst:.0%} (target ≤ 20 %)."]
    return "\n".join(lines) + "\n"


MARKERS = ("<!-- bench_cost_model: begin -->", "<!-- bench_cost_model: end -->")


def write_markdown(path: str, table: str) -> None:
    """Put ``table`` in ``path``: between the two :data:`MARKERS` where the file has them (the
    docs/BENCHMARKS.md includes the benchmark's own output that way), else as the whole file."""
    text = open(path).read() if os.path.exists(path) else ""
    if MARKERS[0] in text and MARKERS[1] in text:
        head, rest = text.split(MARKERS[0], 1)
        tail = rest.split(MARKERS[1], 1)[1]
        text = f"{head}{MARKERS[0]}\n{table}{MARKERS[1]}{tail}"
    else:
        text = table
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args)
    if args.wait_quiet > 0:
        print(f"CPU {wait_quiet(args.wait_quiet):.0f} % busy when starting")
    t0 = time.perf_counter()
    import psutil
    load = ", ".join(f"{x:.1f}" for x in psutil.getloadavg())
    print(f"machine: {os.cpu_count()} CPU cores, load average {load} (1, 5, 15 min) before; "
          f"timings are noisy when it exceeds the core count")
    rows = calibrate.measure_vs_predict(build_configs(args), attempts=args.attempts,
                                        terms=args.terms, tries=args.tries)
    print(calibrate.format_measure_vs_predict(rows))
    for r in rows:
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["breakdown"].items() if v > 0)
        print(f"  {r['config']}: matmul {r['matmul_gflops']} GFLOP/s per rank, memory "
              f"{r['memory_gbs']} GB/s, all-reduce {r['allreduce_latency_ms']} ms + "
              f"{r['allreduce_busbw_gbs']} GB/s (drift before/after "
              f"{r['calibration_drift']:.0%}), host overhead {r['host_overhead_s'] * 1e3:.1f} ms; "
              f"predicted {parts}")
    for r in rows:
        if r.get("terms"):
            print(f"\n{r['config']}: the model's terms against the profile's op classes "
                  f"(slowest rank; 'unprofiled' = the class's share of the profiled step times "
                  f"the measured step)\n{op_classes.format_terms(r['terms'])}")
    worst = max(abs(r["ratio"] - 1) for r in rows)
    load = ", ".join(f"{x:.1f}" for x in psutil.getloadavg())
    elapsed = time.perf_counter() - t0
    print(f"worst |measured/predicted - 1| = {worst:.0%} (target <= 20 %); "
          f"{elapsed:.0f} s in all; load average after: {load}")
    if args.markdown:
        write_markdown(args.markdown, markdown_table(
            rows, argv if argv is not None else sys.argv[1:], worst, elapsed))
    if args.published:
        print()
        print(published_runs.format_published_comparison(
            published_runs.published_runs_comparison()))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
