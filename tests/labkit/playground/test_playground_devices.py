"""The playground's backend and device decisions on machines this one is not, without CUDA and
without starting engines.

Each test plays the engines of a world one after another in this process: it puts the
environment :func:`~mpu_lab.labkit.playground.engine.engine_env` gives engine ``r`` in
``os.environ`` and calls the engine's own :func:`~mpu_lab.labkit.playground.engine.engine_init`
with ``torch.cuda.is_available`` / ``device_count`` faked (0, 1, 2, 4 or 8 GPUs) and
``torch.distributed.init_process_group`` recorded instead of run. So what is checked is the
code a real engine runs: NCCL only when every engine has a GPU of its own, ``cuda:LOCAL_RANK``
like a torchrun worker, GPUs shared round-robin through gloo, the CPU without a GPU, and the
``device`` name in the cell namespace. Values handed back to the notebook are checked too.
"""
from __future__ import annotations

import types

import IPython
import pytest
import torch
import torch.distributed as dist

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state, utils
from mpu_lab.labkit.playground import engine
from mpu_lab.labkit.playground.engine import engine_env
from mpu_lab.labkit.playground.world import check_world_args


@pytest.fixture
def machine(monkeypatch):
    """``machine(gpus, nccl=True)`` fakes a node with ``gpus`` GPUs; returns ``play(world_size,
    backend)``, which runs ``engine_init`` as each engine of such a world and returns one
    record per rank: the reply, the namespace's ``device``, the init_process_group keywords and
    the device ``torch.cuda.set_device`` was given."""
    for name in ("MPU_LAB_DEVICE", "MPU_LAB_BACKEND", "TORCH_NCCL_BLOCKING_WAIT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(initialize, "_INFO", None)
    monkeypatch.setattr(utils, "_DEVICE", None)
    state = {"init": None, "set_device": None}
    shell = types.SimpleNamespace(user_ns={})

    def init_process_group(**kwargs):
        state["init"] = kwargs

    monkeypatch.setattr(dist, "is_initialized", lambda: state["init"] is not None)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: state["init"]["backend"])
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", lambda *a, **k: None)
    monkeypatch.setattr(parallel_state, "destroy_model_parallel", lambda *a, **k: None)
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: state.update(set_device=d))

    def fake(gpus: int, nccl: bool = True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)

        def play(world_size: int, backend: str = "auto", tp: int = 1, pp: int = 1):
            check_world_args(world_size, tp, pp, backend)
            records = []
            for rank in range(world_size):
                state.update(init=None, set_device=None)
                shell.user_ns.clear()
                for key, value in engine_env(rank, world_size, 29500, 15.0).items():
                    monkeypatch.setenv(key, value)
                reply = engine.engine_init(backend, 15.0, tp, pp)
                records.append(dict(reply=reply, device=shell.user_ns["device"],
                                    rank=shell.user_ns["rank"], init=dict(state["init"]),
                                    set_device=state["set_device"]))
            return records
        return play
    return fake


def test_engine_env_is_a_torchrun_workers():
    env = engine_env(3, 8, 29500, 15.0)
    assert env["RANK"] == env["LOCAL_RANK"] == "3"
    assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "8"
    assert env["MASTER_PORT"] == "29500" and env["MPU_LAB_TIMEOUT_S"] == "15.0"
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "1"     # an NCCL timeout raises in the cell


@pytest.mark.parametrize("gpus", [4, 8])
def test_one_gpu_per_engine_is_nccl_on_cuda_local_rank(machine, gpus):
    records = machine(gpus)(4)
    for r, rec in enumerate(records):
        assert rec["rank"] == r
        assert rec["reply"] == {"backend": "nccl", "device": f"cuda:{r}"}
        assert rec["device"] == torch.device("cuda", r)          # the cells' `device`
        assert rec["set_device"] == torch.device("cuda", r)
        assert rec["init"]["backend"] == "nccl"
        assert rec["init"]["device_id"] == torch.device("cuda", r)   # bound to its GPU


def test_one_gpu_shared_by_all_engines_is_gloo_on_cuda0(machine):
    records = machine(1)(4)
    assert [r["reply"] for r in records] == [{"backend": "gloo", "device": "cuda:0"}] * 4
    assert all(r["device"] == torch.device("cuda", 0) for r in records)
    assert all("device_id" not in r["init"] for r in records)   # gloo: no NCCL binding


def test_fewer_gpus_than_engines_share_them_round_robin_through_gloo(machine):
    records = machine(2)(4, tp=2)
    assert {r["reply"]["backend"] for r in records} == {"gloo"}
    assert [str(r["device"]) for r in records] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]


def test_no_gpu_is_gloo_on_the_cpu(machine):
    records = machine(0)(4, tp=2)
    assert [r["reply"] for r in records] == [{"backend": "gloo", "device": "cpu"}] * 4
    assert all(r["device"] == torch.device("cpu") and r["set_device"] is None for r in records)


def test_gpus_without_nccl_fall_back_to_gloo(machine):
    records = machine(8, nccl=False)(4)
    assert [r["reply"]["backend"] for r in records] == ["gloo"] * 4
    assert [str(r["device"]) for r in records] == [f"cuda:{r}" for r in range(4)]


def test_gloo_asked_for_with_a_gpu_each(machine):
    records = machine(8)(4, backend="gloo")
    assert [r["reply"] for r in records] == [{"backend": "gloo", "device": f"cuda:{r}"}
                                             for r in range(4)]


def test_nccl_asked_for_without_a_gpu_each_fails_before_any_engine_starts(machine):
    play = machine(2)
    with pytest.raises(ValueError, match="one GPU per rank"):
        play(4, backend="nccl")
    assert machine(4)(4, backend="nccl")[3]["reply"] == {"backend": "nccl", "device": "cuda:3"}


def test_mpu_lab_device_cpu_keeps_the_engines_on_the_cpu(machine, monkeypatch):
    monkeypatch.setenv("MPU_LAB_DEVICE", "cpu")    # the engines inherit the notebook's env
    records = machine(8)(2)
    assert [r["reply"] for r in records] == [{"backend": "gloo", "device": "cpu"}] * 2


# --------------------------------------------------------------------------- values back
@pytest.fixture
def shell(monkeypatch):
    shell = types.SimpleNamespace(user_ns={"torch": torch, "device": torch.device("cpu"),
                                           "rank": 1})
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    return shell


def test_a_cells_tensor_value_comes_back_on_the_cpu_unchanged(shell):
    reply = engine.run_on_engine("x = torch.full((2,), float(rank), device=device)\n"
                                  "{'x': x, 'both': [x, (x * 2).requires_grad_()]}", rank=1)
    assert "error" not in reply, reply.get("traceback")
    value = reply["value"]
    assert value["x"] is shell.user_ns["x"]           # a CPU tensor is handed back as it is
    assert all(t.device.type == "cpu" for t in [value["x"], *value["both"]])
    assert value["both"][1].requires_grad


def test_values_are_lists_of_floats(shell):
    shell.user_ns["x"] = torch.arange(4, device=torch.device("cpu")).reshape(2, 2)
    assert engine.engine_values("x") == [[0.0, 1.0], [2.0, 3.0]]
    assert engine.engine_values("(x[0], [x[1]])") == ([0.0, 1.0], [[2.0, 3.0]])
    assert engine.engine_values("x.shape") == torch.Size([2, 2])   # not a tensor: as it is
    assert engine.engine_values("None") is None
