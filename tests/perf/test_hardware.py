"""GPU peaks by device name and MFU (mpu_lab.perf.hardware), and lab 14's tokens/s and MFU
(mpu_lab.labkit.train_gpt.runs.throughput) on a hand-worked example."""
import pytest

from mpu_lab.labkit.train_gpt import runs as gpt_runs
from mpu_lab.perf import hardware


@pytest.mark.parametrize("name, key, tflops", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989), ("NVIDIA H100 PCIe", "H100 PCIe", 756),
    ("NVIDIA H200", "H200", 989), ("NVIDIA A100-SXM4-80GB", "A100", 312),
    ("NVIDIA A100 80GB PCIe", "A100", 312), ("NVIDIA A10", "A10", 125),
    ("NVIDIA L4", "L4", 121), ("Tesla T4", "T4", 65), ("Tesla V100-SXM2-16GB", "V100", 125)])
def test_lookup_by_device_name(name, key, tflops):
    peak = hardware.lookup(name)
    assert peak.name == key and peak.tflops == tflops and "datasheet" in peak.source


def test_dense_not_sparse_and_fp16_where_there_is_no_bf16():
    assert hardware.lookup("NVIDIA H100 80GB HBM3").tflops < 1979 / 2 + 1
    assert hardware.lookup("Tesla T4").dtype == "fp16" and hardware.lookup("NVIDIA L4").dtype == "bf16"


@pytest.mark.parametrize("name", [None, "", "cpu", "NVIDIA GeForce RTX 4090"])
def test_no_peak_for_a_cpu_or_an_unknown_gpu(name):
    assert hardware.lookup(name) is None
    assert "no MFU" in hardware.describe(None, name or None)


def test_mfu_by_hand():
    # 1e14 model FLOP/s on one A100 (312e12): 0.3205...; shared by ranks on one GPU: same GPU count
    a100 = hardware.lookup("NVIDIA A100-SXM4-40GB")
    assert hardware.mfu(1e14, a100) == pytest.approx(1e14 / 312e12)
    assert hardware.mfu(8e14, a100, gpus=8) == pytest.approx(1e14 / 312e12)
    with pytest.raises(ValueError):
        hardware.mfu(1.0, a100, gpus=0)


def _run(flags, nproc, tokens_per_s):
    metrics = [dict(iteration=i, lm_loss=1.0, tokens_per_s=t, iteration_time_s=1.0)
               for i, t in enumerate(tokens_per_s, 1)]
    return gpt_runs.TrainRun("TP=1", list(range(1, len(metrics) + 1)), [1.0] * len(metrics),
                             [{"metrics": metrics}] * nproc, 1.0, nproc, flags)


def test_throughput_by_hand(monkeypatch):
    """GPT-2 small's shape, vocabulary 50304 (padded at TP=1): per token
    6·(12·12·768² + 50304·768) + 12·12·768·1024 = 6·123,568,128 + 113,246,208 = 854,654,976
    FLOPs; 10,000 tokens/s on one H100 (989e12) is 8.5465e12 FLOP/s, MFU 0.864 %."""
    flags = gpt_runs.gpt_flags(10, 12, 768, 12, 1024, vocab_size=50257)
    run = _run(flags, 1, [1.0, 9_000, 10_000, 11_000])     # the first (warm-up) is skipped
    monkeypatch.setattr(gpt_runs, "gpus_used", lambda nproc: (1, "NVIDIA H100 80GB HBM3"))
    row = gpt_runs.throughput(run)
    per_token = 6 * (12 * 12 * 768 ** 2 + 50304 * 768) + 12 * 12 * 768 * 1024
    assert per_token == 854_654_976
    assert row["tokens_per_s"] == 10_000 and row["flops_per_token"] == per_token
    assert row["mfu"] == pytest.approx(0.0086416, rel=1e-4)
    assert "6 x 123,568,128 + 12 x 12 x 768 x 1024" in gpt_runs.flop_formula(row["model"])


def test_throughput_on_a_cpu_has_no_mfu(monkeypatch, capsys):
    monkeypatch.setattr(gpt_runs, "gpus_used", lambda nproc: (0, None))
    run = _run(gpt_runs.gpt_flags(4, 2, 64, 4, 64), 2, [100.0, 200.0, 200.0])
    gpt_runs.print_throughput([run])
    text = capsys.readouterr().out
    assert "200 tokens/s" in text and "MFU n/a" in text and "MFU needs a GPU" in text


def test_precision_flags_and_tolerances():
    assert gpt_runs.precision_flags("fp32") == [] and gpt_runs.precision_flags("bf16") == ["--bf16"]
    assert gpt_runs.agreement_rtol("fp32") == 1e-5 < gpt_runs.agreement_rtol("bf16")
    with pytest.raises(ValueError, match="fp32, bf16, fp16"):
        gpt_runs.precision_flags("fp8")
