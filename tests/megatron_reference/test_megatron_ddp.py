"""Megatron-core's DistributedDataParallel and DistributedOptimizer against mpu_lab's and a
single-process AdamW reference (launch/megatron_core_ddp.py), where megatron-core is installed;
the CPU patches are undone after use."""
import pytest
import torch

from documented import COMMANDS, script_and_flags
from mpu_lab import launcher
from mpu_lab.megatron_reference import runtime as megatron_core, ddp as megatron_core_ddp
from mpu_lab.labkit.data_parallel import megatron_core as data_parallel_megatron_core
from mpu_lab.megatron_reference.cpu import CUDA_STAND_INS, cpu_patches


def test_cpu_patches_are_undone_and_rewrite_cuda_requests_inside():
    before = {name: getattr(torch.cuda, name) for name in CUDA_STAND_INS}
    with cpu_patches() as reasons:
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.zeros(2).type() == "torch.cuda.FloatTensor"
        assert all(reasons.values())
    assert {name: getattr(torch.cuda, name) for name in CUDA_STAND_INS} == before
    assert torch.zeros(2).type() == "torch.FloatTensor"


def test_cpu_patches_patch_nothing_on_a_gpu_rank():
    with cpu_patches(on_cpu=False) as reasons:
        assert reasons == {}
        assert torch.zeros(2).type() == "torch.FloatTensor"


@pytest.mark.slow          # starts a 2-rank torchrun job itself
@pytest.mark.skipif(not megatron_core.available(), reason="megatron-core is not installed")
def test_megatron_core_ddp_and_distributed_optimizer_match_mpu_lab_and_the_reference():
    """The command megatron_core_ddp.py's docstring shows, as written (tests/documented.py)."""
    script, flags, nproc = script_and_flags(COMMANDS["megatron_core_ddp.py:1"])
    steps = int(flags[flags.index("--steps") + 1])
    job = launcher.run(script, flags, nproc=nproc, show="none", timeout_s=300)
    results = job.results
    assert [r["rank"] for r in results] == [0, 1]
    assert [m["mode"] for m in results[0]["modes"]] == list(megatron_core_ddp.MODES)
    # both libraries, every rank and mode: within fp32 rounding of the one-process AdamW
    assert data_parallel_megatron_core.worst(results) <= megatron_core_ddp.TOL
    for r in results:
        for m in r["modes"]:
            overlap, dist_opt = megatron_core_ddp.MODES[m["mode"]]
            assert (m["grad"] == {}) == dist_opt
            assert len(m["params"]["megatron-core"]) == len(m["params"]["mpu_lab"]) == steps
            if overlap:       # the MLP's ~3,600 parameters in buckets of 1,000 elements
                assert m["buckets"]["megatron-core"] > 1 and m["buckets"]["mpu_lab"] > 1
    table = data_parallel_megatron_core.format_ddp_results(results)
    assert "within 1e-05 (fp32 rounding): yes" in table


def test_a_skipped_job_prints_how_to_install_megatron_core():
    assert data_parallel_megatron_core.format_ddp_results(
        [{"rank": 0, "skipped": megatron_core.INSTALL_HINT}]) == megatron_core.INSTALL_HINT
