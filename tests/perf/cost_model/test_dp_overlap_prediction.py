"""The overlap model of bucketed data parallelism (mpu_lab.perf.cost_model.dp_overlap) against
timelines worked by hand, the DGX H100 prediction against its arithmetic, and the channel fit
against the channel that made the numbers."""
import pytest

from mpu_lab.perf.cost_model import dp_overlap as M
from mpu_lab.perf.cost_model import DGX_H100
from mpu_lab.perf.cost_model.counts import parameter_count


def test_two_buckets_worked_by_hand():
    # d = 2: ring all-reduce = 2 (d-1) = 2 steps of alpha + 2 (d-1)/d = 1 x bytes / busbw.
    # alpha 1 s, busbw 1 byte/s; buckets of 4 and 2 bytes -> 2 + 4 = 6 s and 2 + 2 = 4 s.
    on = M.bucket_timeline([4, 2], backward_s=9, d=2, alpha_s=1, busbw=1, overlap=True)
    # ready at 9 x 4/6 = 6 and 9; bucket 0 runs 6..12, bucket 1 waits for the channel: 12..16
    assert on.ready_s == [6, 9] and on.start_s == [6, 12] and on.end_s == [12, 16]
    assert on.exposed_s == 7 and on.step_s == 16 and on.comm_s == 10
    off = M.bucket_timeline([4, 2], backward_s=9, d=2, alpha_s=1, busbw=1, overlap=False)
    assert off.start_s == [9, 15] and off.end_s == [15, 19] and off.exposed_s == 10


def test_overlap_hides_all_but_the_last_bucket_when_the_channel_keeps_up():
    t = M.bucket_timeline([1] * 4, backward_s=8, d=2, alpha_s=0, busbw=1, overlap=True)
    assert t.end_s == [3, 5, 7, 9] and t.exposed_s == 1       # the last bucket only


def test_buckets_are_cut_as_megatron_cuts_the_buffer():
    assert M.cut_into_buckets(10, 4) == [16.0, 16.0, 8.0]
    assert M.cut_into_buckets(8, 4, bytes_per_element=2) == [8.0, 8.0]
    with pytest.raises(ValueError, match="numel and bucket_numel must be >= 1"):
        M.cut_into_buckets(0, 4)


def test_dgx_h100_prediction_is_its_arithmetic():
    pred = M.predict_dgx_h100()
    n = 1_317_650_432        # GPT-3 XL: 24 x 12 h^2 + 13 h (h = 2048) + (V + s) h, V = 51200
    assert parameter_count(M.GPT3_XL) == n
    assert M.cut_into_buckets(n, 40_000_000)[-1] == 4.0 * (n - 32 * 40_000_000)
    # backward = 2 x forward; forward per token = 24 (24 h^2 + 4 s h) + 2 h V, 4 x 2048 tokens
    h, s, V = 2048, 2048, 51200
    forward = 4 * 2048 * (24 * (24 * h * h + 4 * s * h) + 2 * h * V)
    assert pred[True].backward_s == pytest.approx(2 * forward / (989e12 * 0.51))
    # without overlap every byte goes after backward: 33 x 14 alpha + 1.75 x 4 n / (0.8 x 450e9)
    comm = 33 * 14 * 10e-6 + 1.75 * 4 * n / (0.8 * 450e9)
    assert pred[False].exposed_s == pytest.approx(comm)
    assert pred[True].exposed_s < 0.05 * pred[False].exposed_s   # hidden but for the last
    assert "overlap saves 23 % of it" in M.format_prediction(pred)
    with pytest.raises(ValueError, match="does not fit in one DGX H100 node"):
        M.predict_dgx_h100(d=16)


def test_the_sweep_loses_at_both_ends():
    rows = M.predict_dgx_h100_sweep([1_000_000, 40_000_000, 2_000_000_000])
    tiny, megatron, one = (r["exposed_on_s"] for r in rows)
    assert megatron < tiny and megatron < one            # latency vs no overlap at all
    assert rows[2]["buckets"] == 1 and rows[2]["exposed_on_s"] == rows[2]["exposed_off_s"]


def test_fit_channel_recovers_the_channel_that_made_the_numbers():
    d, alpha, busbw = 2, 3e-4, 2e9
    rows = [dict(buckets=k, bytes=b, exposed_off_s=k * 2 * alpha + b / busbw)
            for k, b in ((1, 5e5), (7, 5e5), (28, 5e5))]        # a sweep: the same bytes
    fit = M.fit_channel(rows, d)
    assert fit["alpha_s"] == pytest.approx(alpha) and fit["busbw"] == pytest.approx(busbw)
    with pytest.raises(ValueError, match="two bucket counts"):
        M.fit_channel(rows[:1], d)
    # no transfer time left once the latency is taken out: the bandwidth did not show
    flat = [dict(r, exposed_off_s=r["buckets"] * 2 * alpha) for r in rows]
    assert M.fit_channel(flat, d)["busbw"] == float("inf")


def test_bad_inputs_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"bucket_bytes must be a non-empty list"):
        M.bucket_timeline([], 1, 2, 0, 1, True)
    with pytest.raises(ValueError, match=r"d >= 2 ranks, got 1, 1"):
        M.bucket_timeline([1], 1, 1, 0, 1, True)
    assert DGX_H100.gpus_per_node == 8
