"""What Megatron's linear does in backward, timed: a sequence-parallel MLP (column- then
row-parallel) with its collectives overlapped by the gradient GEMMs, against the same layers
with every collective finished before the next GEMM starts (:mod:`mpu_lab.perf.linear_overlap`).

    torchrun --standalone --nproc-per-node 2 launch/linear_overlap.py --seq 512 --batch 4 \
        --hidden 256 --steps 10

Every rank is one tensor-parallel rank (t = the number of ranks). For each mode ("overlap":
``mpu_lab.core.tensor_parallel.linear_autograd`` as it is; "serial": the column-parallel
layer with ``async_comm = False``, which waits for each of its collectives at once) it
times ``--steps`` forward + backward steps and records one backward pass step by step.
Rank 0 prints the table; every rank reports ``{"rank", "t", "device", "modes": {mode:
{"step_ms", "backward_ms", "events"}}}``, event times in ms from the start of that backward.
"""
import sys

import torch

from mpu_lab.training import initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state
from mpu_lab.perf.linear_overlap import check_args, measure
from mpu_lab.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

PRECHECK = "mpu_lab.perf.linear_overlap:check_args"


@launcher.entrypoint
def main(argv=None):
    info = initialize.init()
    t = info.world_size
    a = check_args(sys.argv[1:] if argv is None else argv, t)
    parallel_state.initialize_model_parallel(t)
    device = initialize.get_device()
    torch.manual_seed(0)
    col = ColumnParallelLinear(a.hidden, 4 * a.hidden, gather_output=False,
                               sequence_parallel=True, device=device)
    row = RowParallelLinear(4 * a.hidden, a.hidden, input_is_parallel=True,
                            sequence_parallel=True, device=device)
    x = torch.randn(a.seq // t, a.batch, a.hidden, device=device, requires_grad=True)
    dy = torch.randn(a.seq // t, a.batch, a.hidden, device=device)
    modes = {"overlap": measure(col, row, x, dy, a.steps)}
    col.async_comm = False          # the row-parallel layer communicates after its linear
    modes["serial"] = measure(col, row, x, dy, a.steps)
    lines = launcher.gather_lines(f"{modes['overlap']['step_ms']} {modes['serial']['step_ms']}")
    if lines is not None and not a.quiet:
        print(f"step (forward + backward) of a sequence-parallel MLP, t = {t}, "
              f"[s, b, h] = [{a.seq}, {a.batch}, {a.hidden}], median of {a.steps}:")
        for rank, line in enumerate(lines):
            over, serial = (float(v) for v in line.split())
            print(f"  rank {rank}: overlapped {over:.2f} ms, serial {serial:.2f} ms "
                  f"({100 * (serial - over) / serial:+.0f} % saved)")
    launcher.report({"rank": info.rank, "t": t, "device": str(device), "modes": modes})
    initialize.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
