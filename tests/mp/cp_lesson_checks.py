"""torchrun worker: lab 10's measurements (mpu_lab.labkit.context_parallel.lessons) on 4 ranks, one CP group.

    torchrun --standalone --nproc-per-node 4 tests/mp/cp_lesson_checks.py

Every rank reports ``{"rank", "memory", "flops", "messages"}``: one layer's activation bytes
without and with CP at s = 256, the FLOPs of its causal attention in both layouts (s = 256,
b = 1, n = 2, d = 8), and the messages of one attention forward and backward per comm type
(s = 32, b = 2, n = 4, d = 4). tests/labkit/context_parallel/test_context_parallel_lessons.py asserts them against values
worked by hand.
"""
import torch.distributed as dist

from mpu_lab.core import context_parallel
from mpu_lab.training import initialize
from mpu_lab import launcher
from mpu_lab.labkit.context_parallel import lessons as cp_lessons


@launcher.entrypoint
def main():
    initialize.init()
    world = dist.get_world_size()
    cp_lessons.use_context_parallel(world)
    report = {"rank": dist.get_rank(),
              "memory": cp_lessons.activation_memory_rows([256], 1, 32, 4, world),
              "flops": cp_lessons.attention_flops(256, 1, 2, 8),
              "messages": {ct: cp_lessons.attention_messages(32, 2, 4, 4, ct)
                           for ct in context_parallel.COMM_TYPES}}
    launcher.report(report)
    initialize.shutdown()


if __name__ == "__main__":
    main()
