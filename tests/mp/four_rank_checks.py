"""torchrun worker: every 4-rank check of the package tests in one job — one start of 4 ranks
(each importing torch, on two cores) instead of three.

    torchrun --standalone --nproc-per-node 4 tests/mp/four_rank_checks.py CHECKPOINT_ROOT TRACE_DIR

In the same world, one after the other, model parallel re-initialised by each part:

* ``gpt``: tests/mp/gpt_checks.py (GPTModel under TP, SP and DP against its dense twin, the
  collective counts, the shape table, checkpoints resharded across TP sizes);
* ``pipeline``: tests/mp/pipeline_checks.py (p2p and every schedule against the toy model);
* ``perf``: tests/mp/perf_checks.py (the step-time breakdown at three layouts, the bandwidth
  benchmark's functions);
* ``dp``: tests/mp/dp_checks.py (Megatron's data parallelism and distributed optimizer against
  the plain path at DP = 4 and at DP = 2 with TP or PP, checkpoints across DP sizes);
* ``recompute``: tests/mp/recompute_checks.py (activation recomputation at TP = 2, with and
  without sequence parallelism, against no recomputation, dropout on).

Every rank reports ``{"rank", "gpt", "pipeline", "perf", "dp", "recompute", "seconds"}``; the session
fixture ``four_rank_job`` (tests/conftest.py) starts the job once for
tests/models/test_gpt_mp.py, tests/pipeline_parallel/test_pipeline_mp.py,
tests/perf/test_perf_measure.py, tests/optimizer/test_distrib_optimizer.py and
tests/models/test_recompute_mp.py. Each script still
runs on its own too.
"""
import pathlib
import sys
import time

import torch.distributed as dist

import dp_checks    # this script's folder is first on sys.path
import gpt_checks
import perf_checks
import pipeline_checks
import recompute_checks
from mpu_lab.training import initialize
from mpu_lab import launcher


@launcher.entrypoint
def main():
    t0 = time.perf_counter()
    info = initialize.init()
    out = {"rank": dist.get_rank(), "seconds": {"init": round(time.perf_counter() - t0, 2)}}
    for name, part in [("gpt", lambda: gpt_checks.checks(sys.argv[1])),
                       ("pipeline", pipeline_checks.checks),
                       ("perf", lambda: perf_checks.checks(sys.argv[2], info)),
                       ("dp", lambda: dp_checks.checks(
                           str(pathlib.Path(sys.argv[1]).parent / "dp_ckpt"))),
                       ("recompute", recompute_checks.checks)]:
        t0 = time.perf_counter()
        out[name] = part()
        out["seconds"][name] = round(time.perf_counter() - t0, 2)
    launcher.report(out)
    initialize.shutdown()


if __name__ == "__main__":
    main()
