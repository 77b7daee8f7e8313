"""mpu_lab.core.distributed.allreduce_data_parallel_grads, the data-parallel average of the paths
without a Megatron-DDP buffer (PP > 1 without it, experts without it, a lone MoE layer), and
its rule for a missing gradient: Megatron's (its DDP buffer always exists), so a parameter
with ``.grad is None`` contributes zeros and leaves with a gradient.

* one rank (in this process): a missing gradient becomes zeros, the others stay as they were;
* two ranks (a torchrun job of tests/mp/grad_average_checks.py, slow): values worked by hand,
  a missing gradient in the middle of the coalesced buffer and a missing expert gradient.
"""
import pathlib

import pytest
import torch

from mpu_lab.core.distributed import allreduce_data_parallel_grads

WORKER = pathlib.Path(__file__).resolve().parents[1] / "mp" / "grad_average_checks.py"


def test_one_rank_a_missing_gradient_becomes_zeros(world):
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    a.grad = torch.tensor([2.0, 4.0])
    allreduce_data_parallel_grads([a, b])
    assert a.grad.tolist() == [2.0, 4.0]          # d = 1: the average of one is itself
    assert b.grad is not None and b.grad.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.slow
def test_two_ranks_a_missing_gradient_counts_as_zeros_worked_by_hand():
    from mpu_lab.launcher import run
    job = run(WORKER, [], nproc=2, timeout_s=180, show="none")
    grads = {rep["rank"]: rep["grads"] for rep in job.results}
    # d = 2 for every parameter; dense ones summed over both ranks, the expert over itself
    dense = {"a": [(2 + 6) / 2, (4 + 0) / 2],        # [4, 2]
             "b": [(1 + 0) / 2, (-3 + 0) / 2, (5 + 0) / 2],   # rank 1's missing: zeros
             "c": [(10 + 20) / 2]}                     # [15]: b's zeros kept c aligned
    for rank in (0, 1):
        for name, want in dense.items():
            assert grads[rank][name] == want, (rank, name, grads[rank][name])
    assert grads[0]["e"] == [6 / 2, -2 / 2]            # one expert replica, divided by d
    assert grads[1]["e"] == [0.0, 0.0]                 # missing: zeros, not None
