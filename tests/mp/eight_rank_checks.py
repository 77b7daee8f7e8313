"""torchrun worker: every 8-rank check of the package tests in one job — one start of 8 ranks
(each importing torch, on two cores) instead of three.

    torchrun --standalone --nproc-per-node 8 tests/mp/eight_rank_checks.py CHECKPOINT_DIR METRICS

In the same world, one after the other, model parallel re-initialised by each part:

* ``tp``: tests/mp/tp_checks.py (Megatron's tensor-parallel unit tests and the layers against
  dense twins, tp=4/pp=2 then tp=2/pp=4), each check recorded, the run going on after a failure;
* ``state``: tests/mp/state_checks.py (real process groups against the pure math);
* ``gpt_pipeline``: tests/mp/gpt_pipeline_checks.py (GPT training with pipeline parallelism,
  checkpoints resharded across pipeline sizes).

Every rank reports ``{"rank", "tp", "state", "gpt_pipeline", "seconds"}``; the session fixture
``eight_rank_job`` (tests/conftest.py) starts the job once for
tests/tensor_parallel/test_tensor_parallel_mp.py, tests/test_parallel_state_mp.py and
tests/models/test_gpt_pipeline_mp.py. Each script still runs on its own too.
"""
import sys
import time

import torch
import torch.distributed as dist

import gpt_pipeline_checks   # this script's folder is first on sys.path
import state_checks
import tp_checks
from mpu_lab.training import initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state as ps


@launcher.entrypoint
def main():
    t0 = time.perf_counter()
    initialize.init()
    out = {"rank": dist.get_rank(), "seconds": {"init": round(time.perf_counter() - t0, 2)}}
    # First, as in its own job: the tensor-parallel checks build their tensors with plain
    # factories, on this rank's device.
    t0 = time.perf_counter()
    torch.set_default_device(initialize.get_device())
    out["tp"] = tp_checks.run_checks()
    torch.set_default_device(None)
    out["seconds"]["tp"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    out["state"] = [state_checks.probe(cfg) for cfg in state_checks.CONFIGS]
    out["seconds"]["state"] = round(time.perf_counter() - t0, 2)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    out["gpt_pipeline"] = gpt_pipeline_checks.checks(sys.argv[1], sys.argv[2])
    launcher.report(out)
    initialize.shutdown()


if __name__ == "__main__":
    main()
