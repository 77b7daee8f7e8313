"""Where each rank's memory goes in a training run: parameters, gradients, optimizer states and
activations, measured from the run's own tensors and next to the cost model's prediction, at
several (t, p, d) in one job (lab 04).

    torchrun --standalone --nproc-per-node 4 launch/memory_breakdown.py \
        --configs 1,1,4 2,1,2 1,2,2 2,2,1 --optimizers AdamW distributed   # + train_gpt.py flags

For each configuration and optimizer every rank re-initialises the groups and builds the tiny
GPT with ``mpu_lab.training`` (``parse_args``, ``validate_args``, ``setup``; the model of
``mpu_lab.perf.memory_breakdown.DEFAULT_MODEL`` unless flags such as ``--hidden-size`` say otherwise),
runs ``train_step`` once (so Adam's states exist) and measures its bytes
(:func:`mpu_lab.perf.memory_breakdown.measure_state_bytes`; on CUDA also the peak of each phase of that
step). ``distributed`` adds ``--use-distributed-optimizer``. Rank 0 prints the table; every rank
reports its rows (``launcher.report``). From a notebook::

    rows = mpu_lab.perf.memory_breakdown.run_memory_breakdown([(1, 1, 4), (2, 1, 2)], nproc=4)
"""
import gc
import json
import os
import sys

from mpu_lab.training import initialize
from mpu_lab import launcher
from mpu_lab.perf import memory_breakdown
from mpu_lab.training import setup, train_step

PRECHECK = "mpu_lab.perf.memory_breakdown:precheck"


@launcher.entrypoint
def main(argv=None):
    own, rest, runs = memory_breakdown.precheck(argv, int(os.environ["WORLD_SIZE"]))
    info = initialize.init()
    rows = []
    for config, use, args in runs:
        phases = memory_breakdown.PhasePeaks(info.device)
        phases.start()
        state = setup(args, log=lambda *_: None)
        phases.mark("model build")
        remove = phases.instrument(state)
        train_step(state)
        remove()
        measured = memory_breakdown.measure_state_bytes(state)
        rows += memory_breakdown.rank_rows(args, measured, use, info.rank, phases.peaks)
        del state
        gc.collect()            # free this configuration's model before the next one's groups
    table = [r for r in rows if r["term"] in memory_breakdown.TERMS]
    per_rank = launcher.gather_lines(json.dumps(table))
    if per_rank is not None:
        everyone = [row for text in per_rank for row in json.loads(text)]
        print(memory_breakdown.format_memory_table(memory_breakdown.order_rows(everyone)))
    launcher.report(rows)
    initialize.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
