"""torchrun worker: mpu_lab.perf's measurement tools (bandwidth, breakdown) in one 4-rank job.

    torchrun --standalone --nproc-per-node 4 tests/mp/perf_checks.py TRACE_DIR

* the step-time breakdown of real training at three layouts (TP2 x PP2 under torch.profiler,
  traces to TRACE_DIR; DP4 with the barrier variant; TP4 with sequence parallelism), next to
  the trainer's own iteration times and a CommCounter that counts the same steps' collectives;
* the bandwidth benchmark's functions (launch/bench_bandwidth.py) over the whole world.

Every rank reports a dict; tests/test_perf_measure.py asserts on them (and samples the
workers' CPU use from the launcher while this runs).
"""
import importlib.util
import pathlib
import sys

import torch.distributed as dist

from mpu_lab import comm, distributed, launcher, training

BASE = ["--num-layers", 4, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 16,
        "--vocab-size", 128, "--make-vocab-size-divisible-by", 32, "--train-iters", 5,
        "--log-interval", 1, "--quiet"]
CONFIGS = {
    "tp2_pp2": ["--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2,
                "--micro-batch-size", 2, "--global-batch-size", 8, "--breakdown-profile"],
    "dp4_barrier": ["--micro-batch-size", 2, "--global-batch-size", 8, "--breakdown-barrier"],
    "tp4_sp": ["--tensor-model-parallel-size", 4, "--sequence-parallel", "--micro-batch-size", 4,
               "--global-batch-size", 4, "--breakdown"],
}
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def breakdown_run(flags):
    args = training.validate_args(training.parse_args(BASE + flags), dist.get_world_size())
    state = training.setup(args, log=lambda s: None)
    with comm.CommCounter() as counter:
        metrics = training.train(state, log=lambda s: None)
    collectives = sum(counter.count(kind) for kind in COLLECTIVE_KINDS)
    return dict(breakdown=state.step_timer.report(), metrics=metrics,
                counted_collectives_per_step=collectives / args.train_iters)


def bandwidth(info):
    path = pathlib.Path(launcher.LAUNCH_DIR) / "bench_bandwidth.py"
    spec = importlib.util.spec_from_file_location("bench_bandwidth", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["--min-bytes", "1K", "--max-bytes", "4K", "--iters", "2",
                              "--warmup", "1"])
    return [module.bench(op, size, args, info) for op in args.ops for size in args.sizes]


def checks(trace_dir, info):
    """Every measurement above, in a world of 4 ranks already initialised (``info``: what
    distributed.init returned); returns this rank's dict (also run by
    tests/mp/four_rank_checks.py, next to the other 4-rank checks)."""
    configs = dict(CONFIGS, tp2_pp2=CONFIGS["tp2_pp2"] + [trace_dir])   # the trace folder
    out = {name: breakdown_run(flags) for name, flags in configs.items()}
    out["bandwidth"] = bandwidth(info)
    return out


@launcher.entrypoint
def main():
    info = distributed.init()
    launcher.report(checks(sys.argv[1], info))
    distributed.shutdown()


if __name__ == "__main__":
    main()
