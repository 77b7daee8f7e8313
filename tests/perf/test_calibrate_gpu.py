"""mpu_lab.perf.calibrate_gpu and the GPU branch of mpu_lab.perf.calibrate, on a CPU.

The CUDA-specific lines (events, synchronise) are exercised with fakes that keep a clock; the
rest runs for real on the CPU, or with the measurements replaced by values worked by hand.
"""
import pytest
import torch

from mpu_lab.perf import calibrate, calibrate_gpu
from mpu_lab.perf.cost_model import predict_iteration


class FakeClock:
    def __init__(self):
        self.ms = 0.0


def fake_cuda(monkeypatch, clock):
    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self, stream=None):
            self.at = clock.ms

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.at - self.at            # milliseconds, as CUDA's

    synced = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return synced


def test_cuda_branch_times_with_events_after_warmup_and_a_sync(monkeypatch):
    clock = FakeClock()
    synced = fake_cuda(monkeypatch, clock)
    durations = iter([50.0, 50.0, 4.0, 3.0, 5.0])      # ms: two warm-up calls, three timed
    calls = []

    def fn():
        calls.append(1)
        clock.ms += next(durations)
    best = calibrate_gpu.device_best_time(fn, torch.device("cuda", 0), repeats=3, warmup=2)
    assert best == pytest.approx(3e-3) and len(calls) == 5 and len(synced) == 1


def test_cpu_branch_uses_the_host_clock():
    calls = []
    best = calibrate_gpu.device_best_time(lambda: calls.append(1), "cpu", repeats=4, warmup=1)
    assert len(calls) == 5 and 0 <= best < 0.1
    with pytest.raises(ValueError, match="repeats"):
        calibrate_gpu.device_best_time(lambda: None, "cpu", repeats=0)


def test_gemm_and_copy_rates_by_hand(monkeypatch):
    # real small GEMMs and a copy on the CPU: positive rates
    assert calibrate_gpu.calibrate_gemm([(2, 32, 16, 8)], "cpu", "float32", repeats=2) > 0
    # with every call taking 1 ms: (2·1·64·32·16 + 2·2·8·8·8) FLOPs / 2 ms; 2·1024·2 bytes / 1 ms
    monkeypatch.setattr(calibrate_gpu, "device_best_time", lambda *a, **k: 1e-3)
    flops = calibrate_gpu.calibrate_gemm([(1, 64, 32, 16), (2, 8, 8, 8)], "cpu", "bfloat16")
    assert flops == pytest.approx((65536 + 2048) / 2e-3)
    assert calibrate_gpu.calibrate_device_memory("cpu", 1024, "bfloat16") == pytest.approx(4096e3)
    cal = calibrate_gpu.device_calibration([(1, 64, 32, 16)], "cpu", memory_numel=1024)
    assert cal["device_name"] == "cpu" and cal["gpu_count"] == 0 and cal["dtype"] == "bfloat16"


def test_cluster_gives_each_rank_its_share_of_a_shared_gpu():
    assert calibrate_gpu.device_share(2, 1) == 0.5
    assert calibrate_gpu.device_share(4, 8) == 1.0 and calibrate_gpu.device_share(2, 0) == 1.0
    cal = dict(matmul_flops=400e12, memory_bandwidth=3e12, device_name="NVIDIA H100",
               memory_bytes=80e9, gpu_count=1, dtype="bfloat16", latency_s=20e-6, busbw=5e9)
    cl = calibrate_gpu.gpu_cluster_from(cal, nproc=2)
    assert (cl.peak_flops, cl.hbm_bandwidth, cl.memory_bytes) == (200e12, 1.5e12, 40e9)
    assert (cl.intra_node_bandwidth, cl.latency_s, cl.matmul_efficiency) == (5e9, 20e-6, 1.0)
    assert calibrate.gpu_cluster(2, cal).peak_flops == 200e12     # given: nothing is run
    assert "H100" in cl.name


def test_device_branch_is_picked_automatically(monkeypatch):
    monkeypatch.setattr(calibrate, "gpu_cluster", lambda n, shapes=None: ("gpu", n))
    monkeypatch.setattr(calibrate, "cpu_cluster", lambda n: ("cpu", n))
    monkeypatch.setattr(calibrate, "cuda_available", lambda: True)
    assert calibrate.device_cluster(2) == ("gpu", 2)
    monkeypatch.setattr(calibrate, "cuda_available", lambda: False)
    assert calibrate.device_cluster(2) == ("cpu", 2)


def test_gpu_calibration_of_ranks_has_the_cpu_ones_keys(monkeypatch):
    monkeypatch.setattr(calibrate, "device_calibration", lambda shapes, dtype: dict(
        matmul_flops=100.0, memory_bandwidth=7.0, dtype=dtype, device_name="G",
        memory_bytes=8.0, gpu_count=1))
    monkeypatch.setattr(calibrate, "calibrate_gemm", lambda shapes, dtype: 50.0)
    monkeypatch.setattr(calibrate, "calibrate_allreduce", lambda n, max_bytes: dict(
        latency_s=1e-5, busbw=2e9, nproc=n, rows=[]))
    cal = calibrate.calibrate_gpu_ranks(2, [[(1, 8, 8, 8)], [(1, 4, 4, 4)]], ["float32"] * 2)
    assert cal["matmul_flops_sets"] == [100.0, 50.0] and cal["nproc"] == 2
    assert {"matmul_flops", "memory_bandwidth", "latency_s", "busbw"} <= set(cal)


def test_measure_vs_predict_on_a_gpu_predicts_bf16_on_the_gpu_cluster(monkeypatch):
    seen = []

    def fake_gpu_ranks(n, sets, dtypes):
        seen.append(dtypes)
        return dict(matmul_flops=1e14, matmul_flops_sets=[1e14] * len(sets),
                    memory_bandwidth=1e12, latency_s=1e-5, busbw=1e10, device_name="G",
                    memory_bytes=8e10, gpu_count=2, dtype=dtypes[0], nproc=n)
    monkeypatch.setattr(calibrate, "cuda_available", lambda: True)
    monkeypatch.setattr(calibrate, "calibrate_gpu_ranks", fake_gpu_ranks)
    monkeypatch.setattr(calibrate, "calibrate_ranks", lambda *a: pytest.fail("CPU calibration"))
    monkeypatch.setattr(calibrate, "_least_contended",
                        lambda tc, attempts: dict(best=0.01, median=0.012, cpu_pressure=None))
    tc = calibrate.TrainConfig(dp=2, bf16=True, hidden_size=64, seq_length=32,
                               micro_batch_size=4)
    assert "--bf16" in tc.argv() and "--bf16" not in calibrate.TrainConfig().argv()
    (row,) = calibrate.measure_vs_predict([tc])
    assert seen == [["bfloat16"], ["bfloat16"]]            # before and after the runs
    model, cfg = tc.shapes()
    cluster = calibrate_gpu.gpu_cluster_from(fake_gpu_ranks(2, [0], ["bfloat16"]), 2)
    want = predict_iteration(model, cfg, cluster, dtype_bytes=2, grad_bytes=4).total_s
    assert row["predicted_s"] == pytest.approx(round(want, 4))
    assert row["measured_s"] == 0.01 and row["calibration_drift"] == 0.0


def test_compare_with_model_calibrates_the_gpu_for_gpu_runs(monkeypatch):
    """A run whose ranks report a CUDA device is predicted from the GPU calibration (the
    layer's GEMMs in the lab's dtype), never from the CPU one; twice the measured GEMM rate
    halves the predicted compute (the cost model's compute term is FLOPs / rate)."""
    from mpu_lab.perf import calibrate, runs, utilisation

    seen = []

    def fake_device_calibration(shapes, dtype="bfloat16", **_):
        seen.append((list(shapes), dtype))
        return dict(matmul_flops=rate[0], memory_bandwidth=1e12, dtype=dtype,
                    device_name="Fake GPU", memory_bytes=80e9, gpu_count=2)

    def no_cpu(*args, **kwargs):
        raise AssertionError("the CPU was calibrated for a GPU run")

    monkeypatch.setattr(runs, "device_calibration", fake_device_calibration)
    monkeypatch.setattr(calibrate, "calibrate_matmul", no_cpu)
    monkeypatch.setattr(calibrate, "calibrate_memory_bandwidth", no_cpu)
    report = dict(rank=0, steps=2, step_s=0.5, step_seconds=[0.5, 0.5], parts={"compute": 0.5},
                  calls={}, bytes={}, barrier=False, window=[0.0, 1.0], device="cuda:0",
                  tp=1, pp=1, dp=2, tp_rank=0, pp_rank=0, dp_rank=0)
    run = runs.ProfiledRun("dp2", 2, [report, dict(report, rank=1, dp_rank=1, device="cuda:1")],
                           utilisation.Utilisation("gpu", 0.1, [], {}, 2), [], 1.0)
    tc = calibrate.TrainConfig(dp=2, micro_batch_size=2, num_layers=2, hidden_size=256,
                               num_attention_heads=4, seq_length=128, global_batch_size=4)
    rows_bw = [dict(op="all_reduce", ranks=2, size_bytes=s, time_s=1e-5 + s / 1e11)
               for s in (1 << 16, 1 << 20, 1 << 24)]
    rate = [100e12]
    first = runs.compare_with_model({"dp2": tc}, {"dp2": run}, rows_bw, dtype="bf16")[0]
    rate[0] = 200e12
    second = runs.compare_with_model({"dp2": tc}, {"dp2": run}, rows_bw, dtype="bf16")[0]
    model, cfg = tc.shapes()
    assert seen[0] == (calibrate.layer_matmul_shapes(model, cfg), "bfloat16")
    assert first["matmul_gflops"] == pytest.approx(100e3)
    assert second["causes"]["compute"]["predicted_s"] < first["causes"]["compute"]["predicted_s"]
