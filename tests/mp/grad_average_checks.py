"""torchrun worker (2 ranks): the data-parallel average of the paths without a Megatron-DDP
buffer (:func:`mpu_lab.core.distributed.allreduce_data_parallel_grads`), on hand-set
gradients, one of them missing on one rank.

    torchrun --standalone --nproc-per-node 2 tests/mp/grad_average_checks.py

Expert parallelism 2 (so the dense data-parallel group is both ranks, d = 2, and each rank is
its own expert-data-parallel group). Three dense parameters ``a``, ``b``, ``c`` and one expert
parameter ``e`` (``allreduce = False``); rank 1 has no gradient for ``b`` (the middle of the
coalesced buffer) nor for ``e``. Every rank reports ``{"rank", "grads": {name: list or None}}``;
tests/distributed/test_finalize_model_grads.py holds them to values worked by hand.
"""
import torch
import torch.distributed as dist

from mpu_lab import launcher
from mpu_lab.core import parallel_state
from mpu_lab.core.distributed import allreduce_data_parallel_grads
from mpu_lab.training import initialize

# name -> (gradient on rank 0, gradient on rank 1; None: missing)
GRADS = {"a": ([2.0, 4.0], [6.0, 0.0]),
         "b": ([1.0, -3.0, 5.0], None),
         "c": ([10.0], [20.0]),
         "e": ([6.0, -2.0], None)}


@launcher.entrypoint
def main():
    initialize.init()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    rank = dist.get_rank()
    params = {}
    for name, per_rank in GRADS.items():
        p = torch.nn.Parameter(torch.zeros(len(per_rank[0])))
        if name == "e":
            p.allreduce = False          # Megatron's mark of an expert parameter
        if per_rank[rank] is not None:
            p.grad = torch.tensor(per_rank[rank])
        params[name] = p
    allreduce_data_parallel_grads(list(params.values()))
    launcher.report({"rank": rank,
                     "grads": {n: None if p.grad is None else p.grad.tolist()
                               for n, p in params.items()}})
    initialize.shutdown()


if __name__ == "__main__":
    main()
