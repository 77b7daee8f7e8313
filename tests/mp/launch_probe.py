"""torchrun worker for the launcher tests: all-reduce, report, and misbehave on request.

    FAIL_RANK=2 torchrun --standalone --nproc-per-node 4 tests/mp/launch_probe.py

FAIL_RANK=r makes rank r raise; HANG_RANK=r makes rank r sleep instead of the second
all-reduce (the others time out after MPU_LAB_TIMEOUT_S, or the job's time limit comes first);
SKIP_COLLECTIVE_RANK=r makes rank r skip the second all-reduce and finish (the others lose
their peer). With either of the last two, each rank prints when it enters that all-reduce.
"""
import gc
import os
import time

import torch
import torch.distributed as dist


from mpu_lab.training import initialize
from mpu_lab import launcher


@launcher.entrypoint
def main():
    info = initialize.init()
    t = torch.ones(1) * info.rank
    dist.all_reduce(t)
    print(f"rank {info.rank} of {info.world_size}: all-reduce of ranks = {t.item():.0f}")
    if os.environ.get("FAIL_RANK") == str(info.rank):
        print(f"rank {info.rank} raises at {time.time():.3f}")
        raise ValueError(f"rank {info.rank} fails on purpose")
    if os.environ.get("HANG_RANK") == str(info.rank):
        time.sleep(3600)     # skips the all-reduce below and never returns: the others time out
    if "HANG_RANK" in os.environ or "SKIP_COLLECTIVE_RANK" in os.environ:
        print(f"rank {info.rank} enters the second all-reduce at {time.time():.3f}")
    if os.environ.get("SKIP_COLLECTIVE_RANK") != str(info.rank):
        dist.all_reduce(t)
    launcher.report({"rank": info.rank, "world_size": info.world_size, "sum": t.item(),
                     "backend": info.backend, "device": str(info.device), "pid": os.getpid(),
                     "gc_threshold": list(gc.get_threshold())})
    initialize.shutdown()


if __name__ == "__main__":
    main()
