"""mpu_lab.training.initialize: backend and device choice (pure), and init's early errors."""
import pytest
import torch

from mpu_lab.training import initialize


@pytest.mark.parametrize("local_ranks,gpus,expected", [
    (8, 8, "nccl"),      # a DGX: one GPU per rank
    (4, 8, "nccl"),
    (4, 1, "gloo"),      # one GPU shared by 4 ranks: NCCL would say "Duplicate GPU detected"
    (9, 8, "gloo"),
    (2, 0, "gloo"),      # a laptop CPU
])
def test_backend_is_nccl_only_when_every_local_rank_has_its_own_gpu(local_ranks, gpus, expected, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert initialize.choose_backend(local_ranks, gpus) == expected


def test_shared_gpu_ranks_are_spread_round_robin():
    assert [initialize.choose_device(r, 2) for r in range(4)] == [
        torch.device("cuda", i) for i in (0, 1, 0, 1)]
    assert initialize.choose_device(3, 0) == torch.device("cpu")


def test_init_outside_torchrun_says_how_to_start(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="start this script with torchrun"):
        initialize.init()


@pytest.mark.parametrize("kwargs,needle", [
    (dict(timeout_s=0), "timeout_s must be > 0 seconds, got 0"),
    (dict(backend="mpi"), "backend must be 'auto', 'gloo' or 'nccl', got 'mpi'"),
])
def test_init_rejects_bad_settings_before_starting(kwargs, needle, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError) as err:
        initialize.init(**kwargs)
    assert needle in str(err.value)
    assert not torch.distributed.is_initialized()


def test_nccl_without_enough_gpus_is_refused_with_the_numbers(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="4 local ranks but 0 GPU"):
        initialize.init(backend="nccl")
