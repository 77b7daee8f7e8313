"""Benchmark: a bad and a good split of the same GPT, side by side — utilisation over time and
where each rank's step goes (the pictures of lab 12), from the command line.

    python launch/utilisation.py                         # 4 ranks: PP=4 with 1 micro-batch vs DP=4
    python launch/utilisation.py --nproc 8 --hidden 1024 --heads 16 --seq-length 512 --out runs/util

This is a driver, not a torchrun script: it starts the two ``launch/train_gpt.py --breakdown``
jobs itself (``mpu_lab.perf.runs.profile_training``) while a thread samples every rank
(psutil: is its main thread running or runnable, or ``--metric cpu``: its CPU use), or GPU use
through NVML where there are GPUs. It prints each rank's mean utilisation, how busy the whole
machine was (other processes make the figures slower and noisier), the step breakdown per
rank, and saves both pictures as PNGs under ``--out``. A benchmark that prints figures, not a
test.
"""
import argparse
import pathlib
import sys


def parse_args(argv):
    p = argparse.ArgumentParser(prog="utilisation.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="ranks of both jobs")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=8, help="iterations per run (the first is not timed)")
    p.add_argument("--interval", type=float, default=0.05, help="sampling period, seconds")
    p.add_argument("--barrier", action="store_true", help="--breakdown-barrier instead of --breakdown")
    p.add_argument("--metric", choices=["runnable", "cpu"], default="runnable",
                   help="without GPUs: share of samples each rank's main thread was running or "
                        "runnable, or its CPU use in percent of one core")
    p.add_argument("--out", default="runs/utilisation", help="folder for the PNGs")
    args = p.parse_args(argv)
    if args.layers % args.nproc or args.global_batch % args.nproc:
        p.error(f"--nproc {args.nproc} must divide --layers {args.layers} (one pipeline stage per "
                f"rank) and --global-batch {args.global_batch} (one share per data-parallel rank)")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # imported here, after the argument check: torch and matplotlib take seconds to load
    from mpu_lab.labkit import viz
    from mpu_lab.perf.breakdown import format_breakdown
    from mpu_lab.perf.calibrate import TrainConfig
    from mpu_lab.perf.runs import format_utilisation, profile_training, training_flags
    shape = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                 seq_length=args.seq_length, global_batch_size=args.global_batch,
                 train_iters=args.steps)
    n = args.nproc
    configs = {f"bad: PP={n}, 1 micro-batch": TrainConfig(
                   pp=n, micro_batch_size=args.global_batch, **shape),
               f"good: DP={n}": TrainConfig(
                   dp=n, micro_batch_size=args.global_batch // n, **shape)}
    runs = {}
    for label, tc in configs.items():
        runs[label] = profile_training(training_flags(tc), n, label, interval_s=args.interval,
                                       barrier=args.barrier, cpu_metric=args.metric)
        run = runs[label]
        print(f"{label}: {run.step_s * 1e3:.1f} ms per step (median), job {run.elapsed_s:.1f} s")
    print(format_utilisation(runs))
    for label, run in runs.items():
        print(f"\n{label}\n{format_breakdown(run.reports)}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [viz.save_figure(viz.plot_utilisation({k: r.utilisation for k, r in runs.items()},
                                                  f"Utilisation per rank, {n} ranks"),
                             out / "utilisation_bad_vs_good.png"),
             viz.save_figure(viz.plot_step_breakdown({k: r.reports for k, r in runs.items()},
                                                     "Milliseconds per step, by rank"),
                             out / "step_breakdown_bad_vs_good.png")]
    print("\nsaved " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    main()
