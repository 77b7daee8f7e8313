"""The alpha-beta model of ring collectives (mpu_lab.perf.bandwidth) and lab 02's lessons built on
it (mpu_lab.labkit.collectives.lessons), against values worked by hand."""
import pytest

from mpu_lab import perf
from mpu_lab.labkit.collectives import lessons
from mpu_lab.perf import bandwidth


def test_ring_steps_worked_by_hand():
    # Thakur et al. 2005: a ring reduce-scatter or all-gather over 8 ranks takes 7 steps, the
    # all-reduce both (14); one rank has nothing to send
    assert [bandwidth.ring_steps(op, 8) for op in ("all_reduce", "all_gather", "reduce_scatter")] \
        == [14, 7, 7]
    assert bandwidth.ring_steps("all_reduce", 1) == 0
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        bandwidth.ring_steps("gather", 4)


def test_alpha_beta_seconds_worked_by_hand():
    # 1 GB over 8 ranks, 5 us per step, 100 GB/s of bus bandwidth:
    # 14 x 5 us + 2 x 7/8 x 1e9 / 1e11 s = 70 us + 17.5 ms
    assert bandwidth.alpha_beta_seconds("all_reduce", 1e9, 8, 5e-6, 100e9) == \
        pytest.approx(70e-6 + 17.5e-3)
    with pytest.raises(ValueError, match="bus bandwidth must be > 0"):
        bandwidth.alpha_beta_seconds("all_reduce", 1e9, 8, 5e-6, 0)


def _rows(latency, busbw, n, sizes, noise=()):
    factor = 2 * (n - 1) / n
    noise = list(noise) or [1.0] * len(sizes)
    return [dict(op="all_reduce", ranks=n, size_bytes=s, time_s=(latency + factor * s / busbw) * e)
            for s, e in zip(sizes, noise)]


def test_the_fit_recovers_a_line_exactly():
    rows = _rows(600e-6, 2e9, 4, [4096, 65536, 1 << 20, 1 << 24])
    fit = bandwidth.fit_alpha_beta(rows)
    assert fit["latency_s"] == pytest.approx(600e-6)
    assert fit["alpha_s"] == pytest.approx(100e-6)          # 6 ring steps at n = 4
    assert fit["busbw"] == pytest.approx(2e9)
    assert fit["max_rel_error"] < 1e-9


def test_the_fit_weighs_small_messages_by_relative_error():
    # 10 % noise on the two smallest: the latency stays within it, the bandwidth untouched
    rows = _rows(1e-3, 1e9, 2, [1024, 4096, 1 << 22, 1 << 26], noise=[1.1, 0.9, 1.0, 1.0])
    fit = bandwidth.fit_alpha_beta(rows)
    assert 0.9e-3 <= fit["latency_s"] <= 1.1e-3
    assert fit["busbw"] == pytest.approx(1e9, rel=0.02)


def test_the_fit_refuses_mixed_or_too_few_rows():
    with pytest.raises(ValueError, match=r"several numbers of ranks \[2, 4\]"):
        bandwidth.fit_alpha_beta(_rows(1e-3, 1e9, 2, [1024]) + _rows(1e-3, 1e9, 4, [4096]))
    with pytest.raises(ValueError, match="at least two sizes"):
        bandwidth.fit_alpha_beta(_rows(1e-3, 1e9, 2, [1024]))


def test_ring_traffic_table_worked_by_hand():
    text = lessons.format_ring_traffic(4, 4 * 1024 ** 2, sizes=(2, 8))
    lines = text.splitlines()
    # ring: 2 x 3/4 x 4 MiB = 6 MiB per rank; the root sends 3 x 4 MiB = 12 MiB
    assert lines[3].split()[:5] == ["4", "6", "MiB", "12", "MiB"] and "this world" in lines[3]
    assert lines[4].split()[:5] == ["8", "7", "MiB", "28", "MiB"]


def test_timing_ranks_one_per_core_without_gpus():
    assert lessons.timing_ranks(8, cores=2, gpus=0) == 2
    assert lessons.timing_ranks(2, cores=16, gpus=0) == 2
    assert lessons.timing_ranks(8, cores=2, gpus=8) == 8
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        lessons.timing_ranks(0)


def test_link_models_use_the_cost_model_presets():
    fit = bandwidth.fit_alpha_beta(_rows(200e-6, 1e9, 2, [4096, 1 << 24]))
    rows = lessons.link_models(fit, [perf.DGX_H100], n=8)
    mine, nvlink, ib = rows
    assert mine["latency_s"] == pytest.approx(100e-6 * 14)   # 2 steps fitted, 14 at n = 8
    h100 = perf.DGX_H100
    assert nvlink["busbw"] == pytest.approx(450e9 * h100.bandwidth_efficiency)
    assert ib["busbw"] == pytest.approx(50e9 * h100.bandwidth_efficiency)
    # crossover: latency = 2 (n-1)/n x S / busbw  <=>  S = latency x busbw / (7/4)
    assert nvlink["crossover_bytes"] == pytest.approx(h100.latency_s * nvlink["busbw"] / 1.75)
    assert lessons.all_reduce_seconds(ib, 1e9, 8) == pytest.approx(
        h100.latency_s + 1.75e9 / ib["busbw"])




def test_two_rows_fix_the_line_exactly():
    # 1 ms at 1 MiB and 2 ms at 3 MiB on 2 ranks (bus factor 1): 1 ms per 2 MiB more, so
    # busbw = 2 MiB / 1 ms and latency = 1 ms - 1 MiB / busbw = 0.5 ms
    rows = [dict(op="all_reduce", ranks=2, size_bytes=s, time_s=t)
            for s, t in ((1 << 20, 1e-3), (3 << 20, 2e-3))]
    fit = bandwidth.fit_alpha_beta(rows)
    assert fit["busbw"] == pytest.approx((2 << 20) / 1e-3)
    assert fit["latency_s"] == pytest.approx(0.5e-3)
