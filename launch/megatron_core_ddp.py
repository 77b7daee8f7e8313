"""Megatron-core's DistributedDataParallel and DistributedOptimizer next to mpu_lab's, on the
same MLP and data, against a single-process reference (lab 04).

    torchrun --standalone --nproc-per-node 2 launch/megatron_core_ddp.py --steps 3

Every rank makes mpu_lab's groups (pure data parallelism over the world), then Megatron-core's
parallel state on the same world, and runs :func:`mpu_lab.megatron_reference.ddp.compare_ddp`
for each mode (all-reduce and distributed optimizer, overlap off and on). Each rank reports
max |library - reference| of the gradients and of the parameters after each Adam step.

Megatron-core is optional: where it cannot be imported every rank reports
``{"skipped": "<how to install what is missing>"}`` and the job exits 0. From a notebook::

    job = mpu_lab.launcher.run("megatron_core_ddp.py", [], nproc=2)
    print(mpu_lab.labkit.data_parallel.megatron_core.format_ddp_results(job.results))
"""

from mpu_lab.training import flag_errors, initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state as ps
from mpu_lab.megatron_reference import runtime as mc
from mpu_lab.megatron_reference import cpu as mcc
from mpu_lab.megatron_reference import ddp as mcd


@launcher.entrypoint
def main():
    parser = flag_errors.ArgumentParser(description="Megatron-core's DDP and distributed "
                                     "optimizer vs mpu_lab's, side by side")
    parser.add_argument("--steps", type=int, default=3, help="Adam steps per mode (>= 1)")
    parser.add_argument("--modes", default=",".join(mcd.MODES),
                        help=f"comma-separated, of: {', '.join(mcd.MODES)}")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in mcd.MODES]
    if bad or args.steps < 1:
        parser.error(f"--modes {bad} unknown (known: {', '.join(mcd.MODES)}) or "
                     f"--steps {args.steps} < 1")
    rank = mcc.start_job(mc.missing(), more_warnings=(".*Transformer Engine.*", ".*Apex.*"))
    if rank is None:
        return
    ps.initialize_model_parallel()
    results = mcd.run_rank(modes, args.steps)
    launcher.report(results)
    lines = launcher.gather_lines(f"rank {rank}: max |library - reference| = "
                                  f"{mcd.worst([results]):.1e}")
    if lines is not None:
        print("\n".join(lines))
    ps.destroy_model_parallel()
    initialize.shutdown()


if __name__ == "__main__":
    main()
