"""mpu_lab's tensor-parallel layers and mappings next to Megatron-core's own, on one world.

    torchrun --standalone --nproc-per-node 4 launch/megatron_core_side_by_side.py --what all

Every rank makes mpu_lab's groups (TP = ``--tp``, default the world size), then Megatron-core's
parallel state on the same world (:func:`mpu_lab.megatron_reference.runtime.initialize`), and checks
that both give this rank the same groups. ``--what column`` / ``row`` builds both libraries'
``ColumnParallelLinear`` / ``RowParallelLinear`` from the same master weight and runs the same
input forward and backward through both; ``--what mappings`` runs the seven mappings (copy,
reduce, scatter, gather and the sequence-parallel trio) on the same tensors; ``all`` does
everything. Each rank reports max |mpu_lab - Megatron-core| of outputs and gradients.
``--sequence-parallel`` also runs the layers in Megatron-LM's sequence-parallel pairing.

Megatron-core is optional: where it cannot be imported every rank reports
``{"skipped": "<how to install what is missing>"}`` (:func:`mpu_lab.megatron_reference.runtime.missing`)
and the job exits 0.

From a notebook::

    job = mpu_lab.launcher.run("megatron_core_side_by_side.py", ["--what", "column"], nproc=4)
    print(mpu_lab.labkit.column_parallel.megatron_core.format_results(job.results))
"""
import os
import warnings

from mpu_lab.training import flag_errors, initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state as ps
from mpu_lab.megatron_reference import layers, runtime

TOL = 1e-6   # fp32: the two libraries do the same matmuls and collectives


def check(results, tol=TOL):
    """The largest difference in ``results`` (one rank's report), asserted <= ``tol``."""
    diffs = [v for kind in layers.LINEAR_KINDS if kind in results
             for k, v in results[kind].items() if k in ("output", "input_grad", "weight_grad",
                                                         "bias_grad")]
    diffs += [v for m in results.get("mappings", {}).values() for k, v in m.items()
              if k in ("forward", "backward")]
    worst = max(diffs, default=0.0)
    assert worst <= tol, f"mpu_lab and Megatron-core differ by {worst:.3g} > {tol:g}: {results}"
    assert results["groups_equal"], f"the two libraries made different groups: {results}"
    return worst


@launcher.entrypoint
def main():
    parser = flag_errors.ArgumentParser(description="mpu_lab vs Megatron-core, side by side")
    parser.add_argument("--what", choices=("column", "row", "mappings", "all"), default="all")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel size (default: the world size)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    reason = runtime.missing()
    if reason is not None:
        launcher.report({"rank": rank, "skipped": reason})
        if rank == 0:
            print(reason)
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    t = args.tp or world
    if world % t:
        parser.error(f"--tp {t} does not divide the world of {world} ranks")

    # Expected noise, hidden: Megatron-core warns that CUDA_DEVICE_MAX_CONNECTIONS is unset (a
    # speed hint for GPUs) and calls torch collectives that recent torch marks deprecated.
    for message in (".*CUDA_DEVICE_MAX_CONNECTIONS.*", ".*is deprecated.*"):
        warnings.filterwarnings("ignore", message=message)
    initialize.init()
    ps.initialize_model_parallel(tensor_model_parallel_size=t)
    state = runtime.initialize()
    results = {"rank": rank, "tp": t, "megatron_core": runtime.version(),
               "groups_equal": state["groups_equal"], "cpu_patch": state["cpu_patch"],
               "sequence_parallel": args.sequence_parallel}
    for kind in ("column", "row"):
        if args.what in (kind, "all"):
            results[kind] = layers.compare_linear(kind, seed=args.seed)
            if args.sequence_parallel:
                results[kind + "_sp"] = layers.compare_linear(kind, sequence_parallel=True,
                                                          seed=args.seed)
    if args.what in ("mappings", "all"):
        results["mappings"] = layers.compare_mappings(seed=args.seed)
    results["max_diff"] = check(results)
    launcher.report(results)
    lines = launcher.gather_lines(f"rank {rank}: max |mpu_lab - Megatron-core| = "
                                  f"{results['max_diff']:.1e}")
    if lines is not None:
        print("\n".join(lines))
    runtime.destroy()
    initialize.shutdown()


if __name__ == "__main__":
    main()
