"""Lab 05's Megatron-core side by side, without a world: the patches are undone on leaving
(torch.cuda is what it was), and the printed verdict follows from the differences it is given
against the stated bound (values made up by hand)."""
import torch

from mpu_lab.labkit.sharded_data_parallel import megatron_core
from mpu_lab.megatron_reference import cpu


def test_the_patches_are_undone_on_leaving():
    names = ("current_device", "Event", "Stream", "current_stream", "synchronize")
    before = {n: getattr(torch.cuda, n) for n in names}
    with cpu.megatron_fsdp_patches():
        assert torch.cuda.current_device() == 0
        assert torch.cuda.current_stream().record_event().wait() is None
    assert {n: getattr(torch.cuda, n) for n in names} == before


def test_the_verdict_follows_the_differences_and_names_a_blocker():
    results = [dict(rank=r, d=2, steps=3, **{"mpu_lab": 3e-8, "megatron-core": 2e-6 * r})
               for r in range(2)]
    text = megatron_core.format_comparison(results, bound=1e-6)
    assert "mpu_lab: within 1e-06 on every rank" in text
    assert "megatron-core: NOT within 1e-06 on every rank" in text
    results[1]["megatron-core"] = "RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo"
    assert "megatron-core: RuntimeError: Cannot use ReduceOp.PREMUL_SUM" in \
        megatron_core.format_comparison(results)
