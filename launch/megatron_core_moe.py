"""Megatron-core's MoELayer against mpu_lab's, on the same weights and input.

    torchrun --standalone --nproc-per-node 4 launch/megatron_core_moe.py --cases ep2/alltoall/top2 ep4/allgather/top1

Every rank runs each case of ``--cases`` (``[tpT-]epE[-etpX]/alltoall|allgather/topK``,
:func:`mpu_lab.megatron_reference.moe.parse_case`) through both libraries' MoE layers on the
CPU (:func:`mpu_lab.megatron_reference.moe.compare_case`) and reports the largest
differences of outputs and gradients.

Megatron-core is optional: where it cannot be imported every rank reports
``{"skipped": "<how to install it>"}`` and the job exits 0.

From a notebook::

    from mpu_lab.labkit.mixture_of_experts import megatron_core
    print(megatron_core.format_results(megatron_core.run_side_by_side(["ep2/alltoall/top2"])))
"""
import os

from mpu_lab.training import flag_errors, initialize
from mpu_lab import launcher
from mpu_lab.megatron_reference import runtime as mc
from mpu_lab.megatron_reference import cpu as mcc
from mpu_lab.megatron_reference import moe as mcm


@launcher.entrypoint
def main():
    parser = flag_errors.ArgumentParser(description="Megatron-core's MoELayer vs mpu_lab's")
    parser.add_argument("--cases", nargs="+", default=list(mcm.DEFAULT_CASES))
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cases = [mcm.parse_case(name, world_size) for name in args.cases]
    except ValueError as exc:    # refused before any process group starts, on rank 0 only
        parser.error(str(exc))
    rank = mcc.start_job(mc.missing())
    if rank is None:
        return
    results = [mcm.compare_case(case) for case in cases]
    launcher.report({"rank": rank, "megatron_core": mc.version(), "cases": results})
    lines = launcher.gather_lines(f"rank {rank}: " + ", ".join(
        f"{r['case']} out {r['out']:.1e} dx {r['dx']:.1e}" for r in results))
    if lines is not None:
        print("\n".join(lines))
    initialize.shutdown()


if __name__ == "__main__":
    main()
