"""The 1F1B bubble measured on this machine: one pipeline, each rank on a core of its own.

    torchrun --standalone --nproc-per-node 2 launch/pipeline_bubble.py --microbatches 1 8

Every rank is one pipeline stage of the toy model (:data:`mpu_lab.perf.pipeline_bubble.TIMING_TOY`).
On a CPU each rank first pins itself to a core of its own with one thread
(:func:`mpu_lab.perf.pipeline_bubble.pin_this_rank`). For each micro-batch count it runs a
warm-up iteration and ``--iterations`` timed ones of mpu_lab's 1F1B, and reads its own clocks:
wall time between two barriers, busy time from hooks on its model chunk, and its main thread's
CPU time (:func:`mpu_lab.perf.pipeline_bubble.time_iterations`). Rank 0 prints the idle share
next to (p-1)/(m+p-1); each rank reports its numbers to the launcher.

From a notebook::

    from mpu_lab.perf.pipeline_bubble import measure_bubble
    print(measure_bubble(2, (1, 8)).summary())
"""
import os

from mpu_lab.training import flag_errors, initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state as ps
from mpu_lab.perf import pipeline_bubble, rank_clock


@launcher.entrypoint
def main():
    parser = flag_errors.ArgumentParser(description="the 1F1B bubble, measured per rank")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    cores_available = len(rank_clock.usable_cores())
    core = pipeline_bubble.pin_this_rank()     # before the process group: its threads inherit it
    initialize.init()
    p = int(os.environ["WORLD_SIZE"])
    ps.initialize_model_parallel(pipeline_model_parallel_size=p)
    runs = [pipeline_bubble.time_iterations(m, args.iterations) for m in args.microbatches]
    launcher.report({"core": core, "cores_available": cores_available, "runs": runs,
                     "device": str(initialize.get_device())})
    for m, run in zip(args.microbatches, runs):
        share = 1 - sum(run["busy_s"]) / sum(run["wall_s"])
        lines = launcher.gather_lines(f"rank {ps.get_pipeline_model_parallel_rank()}, m = {m}: "
                                      f"busy {sum(run['busy_s']):.3f} s of "
                                      f"{sum(run['wall_s']):.3f} s (idle {share:.2f})")
        if lines is not None:
            print("\n".join(lines))
    ps.destroy_model_parallel()
    initialize.shutdown()


if __name__ == "__main__":
    main()
