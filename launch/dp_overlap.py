"""Megatron's data parallelism, timed: the small GPT of ``train_gpt.py`` at DP = the number of
ranks, its gradients in buckets of the mirror's ``DistributedDataParallel``, reduced after
backward or during it (``--overlap-grad-reduce``), by an all-reduce or by the distributed
optimizer's reduce-scatter (:mod:`mpu_lab.perf.dp_overlap`).

    torchrun --standalone --nproc-per-node 4 launch/dp_overlap.py --steps 3 \
        --bucket-size 100000 --num-layers 4 --hidden-size 128 --seq-length 128 \
        --micro-batch-size 4 --global-batch-size 16

Flags other than ``--steps``, ``--warmup``, ``--bucket-size``, ``--modes`` and
``--profile-dir`` (lab 08's profiler traces, ``DIR/<mode number>/rank<r>.trace.json``) go to
``train_gpt.py``'s parser (the model and the batch). For each mode (``--modes``, default all
of ``dp_overlap.MODES``) every rank sets the model up afresh, runs the warm-up steps, then
times ``--steps`` steps. Rank 0 prints one line per mode; every rank reports
``{"rank", "d", "device", "modes": {mode: dp_overlap.measure(...)}}``.
"""
import os
import sys

import torch.distributed as dist

from mpu_lab import distributed, launcher
from mpu_lab.perf import dp_overlap

PRECHECK = "mpu_lab.perf.dp_overlap:check_args"


@launcher.entrypoint
def main(argv=None):
    info = distributed.init()
    a, train_argv = dp_overlap.check_args(sys.argv[1:] if argv is None else argv,
                                          info.world_size)
    modes = {}
    for i, mode in enumerate(a.modes):
        profile = os.path.join(a.profile_dir, str(i)) if a.profile_dir else None
        modes[mode] = rec = dp_overlap.measure(train_argv, mode, a.steps, a.warmup, profile)
        exposed = sorted(s["exposed_ms"] for s in rec["steps"])[len(rec["steps"]) // 2]
        lines = launcher.gather_lines(f"{exposed:.1f}")
        if lines is not None:
            print(f"{mode}: {len(rec['buckets'])} buckets; exposed communication per rank "
                  f"(ms, median of {a.steps}): {', '.join(lines)}")
        dist.barrier()
    launcher.report({"rank": info.rank, "d": info.world_size,
                     "device": str(distributed.get_device()), "modes": modes})
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
