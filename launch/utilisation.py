"""Benchmark: a bad split of a GPT, its remedy and a good split, side by side — each rank's busy
and idle time, utilisation over time and where each rank's step goes (the pictures of lab 15).

    python launch/utilisation.py                  # CPU: one rank per core (2 on 2 cores)
    python launch/utilisation.py --nproc 8 --layers 24 --hidden 1024 --heads 16 \\
        --seq-length 1024 --global-batch 32 --dtype bf16 --out runs/util      # 8 GPUs

The three runs train the same model on the same batch with the same ranks n:
bad = a pipeline of n stages fed one micro-batch (each stage idle (n-1)/n of the step),
remedy = the same pipeline fed ``--microbatches`` micro-batches, good = n data-parallel replicas.

This is a driver, not a torchrun script: it starts the three ``launch/train_gpt.py --breakdown``
jobs itself (``mpu_lab.perf.bad_vs_good``). Without GPUs each job gets at most one rank per
usable core (fewer cores than ``--nproc``: it says so and runs fewer ranks), every rank pinned
to its own core with one thread, and each rank's busy and idle time is read from its own CPU
clock; with GPUs NVML's utilisation is sampled. On CPU ranks, sizes that would keep a
pipeline rank waiting for one message past the collective timeout (the 8-GPU line above, on
a laptop) are refused before any job starts, with the estimate and what would do. It prints
the step times, the busy and idle time per rank, the step breakdown per rank, saves the runs
(utilisation samples and breakdowns) as ``bad_vs_good.json`` under ``--out`` for lab 15's pictures
(:func:`mpu_lab.perf.bad_vs_good.load_runs`), and ends with the line

    speed-up over the bad configuration: remedy R.RR x, good G.GG x

(the fastest timed step of the bad run over each other run's). Other processes on the machine
slow every run; a quiet machine gives the figures the lesson is about.
"""
import argparse
import pathlib
import sys


def parse_args(argv):
    p = argparse.ArgumentParser(prog="utilisation.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks of every job (default: the GPUs, else the usable cores, at most 4)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=8, help="the remedy's micro-batches")
    p.add_argument("--steps", type=int, default=6, help="iterations per run (the first is not timed)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--interval", type=float, default=0.05, help="sampling period, seconds")
    p.add_argument("--out", default="runs/utilisation", help="folder for the PNGs")
    args = p.parse_args(argv)
    if args.nproc is not None and args.nproc < 2:
        p.error(f"--nproc {args.nproc}: a pipeline against data parallelism needs at least 2 ranks")
    for name in ("layers", "hidden", "heads", "seq_length", "global_batch", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps < 2:
        p.error(f"--steps {args.steps}: the first iteration is not timed; give at least 2")
    if args.hidden % args.heads:
        p.error(f"--heads {args.heads} must divide --hidden {args.hidden}")
    if not args.interval > 0:
        p.error(f"--interval must be > 0 seconds, got {args.interval}")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # imported here, after the argument check: torch and matplotlib take seconds to load
    import torch
    from mpu_lab.perf.runs import precision_flags
    from mpu_lab.perf import bad_vs_good
    from mpu_lab.perf.breakdown import format_breakdown
    from mpu_lab.perf.rank_clock import usable_cores

    gpus = torch.cuda.device_count()
    requested = args.nproc or (gpus if gpus >= 2 else min(4, len(usable_cores())))
    n, note = bad_vs_good.timing_ranks(requested, on_gpu=gpus >= 2)
    if note:
        print(f"note: {note}")
    try:
        configs = bad_vs_good.bad_vs_good_configs(
            n, args.layers, args.hidden, args.heads, args.seq_length, args.vocab_size,
            args.global_batch, args.steps, args.microbatches)
    except ValueError as e:
        sys.exit(f"utilisation.py: {e}")
    runs = bad_vs_good.run_bad_vs_good(configs, precision_flags(args.dtype),
                                       interval_s=args.interval)
    print(bad_vs_good.format_steps(runs))
    print("\nbusy and idle time per rank, from each rank's own clock:")
    print(bad_vs_good.format_busy_idle(runs, configs))
    for label, run in runs.items():
        print(f"\n{label}\n{format_breakdown(run.reports)}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = bad_vs_good.save_runs(runs, out / "bad_vs_good.json")
    print(f"\nsaved {path} (lab 15 draws it: mpu_lab.labkit.performance.viz.plot_utilisation, "
          "plot_step_breakdown of mpu_lab.perf.bad_vs_good.load_runs)")
    print(bad_vs_good.speedup_line(runs))


if __name__ == "__main__":
    main()
