"""torchrun worker: mpu_lab.perf's measurement tools (bandwidth, breakdown) in one 4-rank job.

    torchrun --standalone --nproc-per-node 4 tests/mp/perf_checks.py TRACE_DIR

* the step-time breakdown of real training at three layouts (TP2 x PP2 under torch.profiler,
  traces to TRACE_DIR; DP4 with the barrier variant; TP4 with sequence parallelism), next to
  the trainer's own iteration times and a dispatch mode counting the same steps' c10d
  collectives from outside;
* the bandwidth benchmark's functions (launch/bench_bandwidth.py) over the whole world.

Every rank reports a dict; tests/perf/test_perf_measure.py asserts on them (and samples the
workers' CPU use from the launcher while this runs).
"""
import importlib.util
import pathlib
import sys

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from mpu_lab.training import initialize
from mpu_lab import launcher, training
from mpu_lab.perf import breakdown

BASE = ["--num-layers", 4, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 16,
        "--vocab-size", 128, "--make-vocab-size-divisible-by", 32, "--train-iters", 3,
        "--log-interval", 1, "--quiet"]
CONFIGS = {
    "tp2_pp2": ["--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2,
                "--micro-batch-size", 2, "--global-batch-size", 8, "--breakdown-profile"],
    "dp4_barrier": ["--micro-batch-size", 2, "--global-batch-size", 8, "--breakdown-barrier"],
    "tp4_sp": ["--tensor-model-parallel-size", 4, "--sequence-parallel", "--micro-batch-size", 4,
               "--global-batch-size", 4, "--breakdown"],
}
# the c10d ops of mpu_lab.core.comm's collectives, as the dispatcher names them
C10D_COLLECTIVES = ("c10d.allreduce_", "c10d.allgather_", "c10d.reduce_scatter_",
                    "c10d._reduce_scatter_base_", "c10d.broadcast_")


class C10dCount(TorchDispatchMode):
    """Counts the c10d collectives dispatched while it is active: a count independent of the
    step timer. (torch's CommDebugMode also tracks modules, and its tracker loses
    its place when a pipeline schedule runs a forward after a backward: IndexError in
    ``_fw_set_module_hook``, torch 2.13.)"""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(getattr(func, "_overloadpacket", "")) in C10D_COLLECTIVES:
            self.count += 1
        return func(*args, **(kwargs or {}))


class CountPerStep(training.Callback):
    """The collectives ``counter`` saw in each step, between the loop's step-begin and
    step-end hook points."""

    def __init__(self, counter: C10dCount):
        self.counter, self.per_step, self.before = counter, [], 0

    def on_step_begin(self, state):
        self.before = self.counter.count

    def on_step_end(self, state, step):
        self.per_step.append(self.counter.count - self.before)


def breakdown_run(flags):
    args = training.validate_args(training.parse_args(BASE + flags), dist.get_world_size())
    state = training.setup(args, log=lambda s: None)
    timer = breakdown.step_timer_for(args)        # as launch/train_gpt.py --breakdown
    counter = C10dCount()
    count = CountPerStep(counter)
    with counter:
        metrics = training.train(state, log=lambda s: None, callbacks=[count, timer])
    per_step = count.per_step
    # the last step: torch DDP rebuilds its buckets over the first two (broadcasts of its own,
    # outside mpu_lab.core.comm); from then on every step issues the same collectives
    return dict(breakdown=timer.report(), metrics=metrics, counted_per_step=per_step,
                counted_collectives_per_step=per_step[-1])


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
    initialize.init returned); returns this rank's dict (also run by
    tests/mp/four_rank_checks.py, next to the other 4-rank checks)."""
    configs = dict(CONFIGS, tp2_pp2=CONFIGS["tp2_pp2"] + [trace_dir])   # the trace folder
    out = {name: breakdown_run(flags) for name, flags in configs.items()}
    out["bandwidth"] = bandwidth(info)
    return out


@launcher.entrypoint
def main():
    info = initialize.init()
    launcher.report(checks(sys.argv[1], info))
    initialize.shutdown()


if __name__ == "__main__":
    main()
