"""Benchmark: how long from `torchrun` to the first finished collective, for 2, 4 and 8 ranks.

    python launch/bench_startup.py                 # driver: runs the job below for 2, 4, 8 ranks
    python launch/bench_startup.py --ranks 2 4     # pick the world sizes
    torchrun --standalone --nproc-per-node 4 launch/bench_startup.py   # one job by hand

Each rank notes when its Python started, when torch was imported, when the process group
was up and when a first all-reduce finished; the driver prints the slowest rank's times
since the launch (the moment `mpu_lab.launcher.run` started torchrun). This is a benchmark that
prints figures, not a test: the numbers depend on the machine (cores, disk cache, GPUs).
"""
import os
import time

T_PYTHON = time.time()


def worker():
    import torch
    t_torch = time.time()
    import torch.distributed as dist

    from mpu_lab.training import initialize
    from mpu_lab import launcher
    info = initialize.init()
    t_init = time.time()
    x = torch.ones(1, device=info.device)
    dist.all_reduce(x)
    if x.is_cuda:
        torch.cuda.synchronize()
    t_first = time.time()
    t0 = float(os.environ.get("MPU_LAB_T0", T_PYTHON))
    launcher.report({"python": T_PYTHON - t0, "torch": t_torch - t0, "init": t_init - t0,
                   "first_collective": t_first - t0, "backend": info.backend})
    initialize.shutdown()


def driver(ranks, repeats):
    from mpu_lab.launcher import run
    print(f"{'ranks':>5} {'python up':>10} {'torch imported':>15} {'group up':>9} "
          f"{'first all-reduce':>17} {'job total':>10}  backend   (seconds since launch, slowest rank; best of {repeats})")
    for n in ranks:
        best = None
        for _ in range(repeats):
            t0 = time.time()
            job = run(__file__, nproc=n, show="none", env={"MPU_LAB_T0": repr(t0)}, timeout_s=300)
            total = time.time() - t0
            worst = {k: max(r[k] for r in job.results) for k in ("python", "torch", "init", "first_collective")}
            if best is None or worst["first_collective"] < best[0]["first_collective"]:
                best = (worst, total, job.results[0]["backend"])
        w, total, backend = best
        print(f"{n:>5} {w['python']:>10.2f} {w['torch']:>15.2f} {w['init']:>9.2f} "
              f"{w['first_collective']:>17.2f} {total:>10.2f}  {backend}")


def parse_args(argv=None):
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=2)
    return parser.parse_args(argv)


if __name__ == "__main__":
    if "RANK" in os.environ:
        worker()
    else:
        a = parse_args()
        driver(a.ranks, a.repeats)
