"""Megatron-core's 1F1B and interleaved schedules against mpu_lab's, on the same toy stages.

    torchrun --standalone --nproc-per-node 2 launch/megatron_core_schedules.py --cases 1f1b interleaved

Every rank is one pipeline stage on the CPU (gloo). For each case of
:data:`mpu_lab.megatron_reference.schedules.CASES` the ranks run one iteration of the toy
tied-embedding model through Megatron-core's schedule, through mpu_lab's, and as the
single-process twin (:func:`mpu_lab.megatron_reference.schedules.compare_case`), and report
the largest differences of their stage gradients. ``interleaved-batched`` is Megatron-core's
default batched p2p, which gives wrong gradients on gloo at two stages (it is reported, not
raised).

Megatron-core is optional: where it cannot be imported every rank reports
``{"skipped": "<how to install it>"}`` and the job exits 0.

From a notebook::

    from mpu_lab.labkit.pipeline_parallel import megatron_core
    print(megatron_core.format_results(megatron_core.run_side_by_side(["1f1b", "interleaved"])))
"""
import argparse

from mpu_lab.training import initialize
from mpu_lab import launcher
from mpu_lab.megatron_reference import runtime as mc
from mpu_lab.megatron_reference import cpu as mcc
from mpu_lab.megatron_reference import schedules as mcs


@launcher.entrypoint
def main():
    parser = argparse.ArgumentParser(description="Megatron-core's pipeline schedules vs mpu_lab's")
    parser.add_argument("--cases", nargs="+", choices=list(mcs.CASES), default=["1f1b", "interleaved"])
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    rank = mcc.start_job(mc.missing())
    if rank is None:
        return
    cases = [mcs.compare_case(mcs.CASES[name], args.num_microbatches, args.seed)
             for name in args.cases]
    launcher.report({"rank": rank, "megatron_core": mc.version(), "cases": cases})
    lines = launcher.gather_lines(f"rank {rank}: " + ", ".join(
        f"{c['case']} {c['megatron_vs_mpu_lab']:.1e}" for c in cases))
    if lines is not None:
        print("\n".join(lines))
    initialize.shutdown()


if __name__ == "__main__":
    main()
