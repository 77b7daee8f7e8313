"""What Megatron's linear does in backward, read from a recorded timeline (mpu_lab.perf.
linear_overlap): which GEMM ran while which collective was in flight, and bad sizes refused
before anything starts. The real run is lab 09's 'Going further' section (nbval)."""
import pytest

from mpu_lab.perf import linear_overlap

# One recorded backward of a column -> row MLP under sequence parallelism, ms, written by hand:
# the row-parallel layer first (no communication inside it), then the column-parallel one.
OVERLAPPED = [("dX = dY W", 0.0, 2.0), ("dW = dY^T X", 2.0, 4.0),
              ("dX = dY W", 5.0, 7.0), ("all-gather X", 4.9, 7.5),
              ("dW = dY^T X", 7.6, 9.6), ("reduce-scatter dX", 7.55, 9.8)]
SERIAL = [("dX = dY W", 0.0, 2.0), ("dW = dY^T X", 2.0, 4.0),
          ("all-gather X", 4.0, 5.0), ("dX = dY W", 5.1, 7.1),
          ("reduce-scatter dX", 7.2, 8.0), ("dW = dY^T X", 8.1, 10.1)]


def test_in_flight_names_the_gemm_each_collective_hid():
    assert linear_overlap.in_flight(OVERLAPPED) == [("all-gather X", ["dX = dY W"]),
                                                    ("reduce-scatter dX", ["dW = dY^T X"])]
    assert linear_overlap.in_flight(SERIAL) == [("all-gather X", []), ("reduce-scatter dX", [])]
    report = {"rank": 0, "device": "cpu",
              "modes": {"overlap": {"events": OVERLAPPED, "step_ms": 9.0},
                        "serial": {"events": SERIAL, "step_ms": 12.0}}}
    text = linear_overlap.format_in_flight(report)
    assert "overlap  all-gather X       in flight during: dX = dY W" in text
    assert "serial   reduce-scatter dX  in flight during: nothing" in text
    assert linear_overlap.format_saving([report]) == \
        "rank 0: overlapped 9.0 ms, serial 12.0 ms (+25 % saved) on cpu"


def test_sizes_that_cannot_be_split_are_refused_naming_them():
    with pytest.raises(ValueError, match="--seq 510 is not divisible by t = 4 ranks"):
        linear_overlap.check_args(["--seq", 510], 4)
    with pytest.raises(ValueError, match="--steps 0 must be >= 1"):
        linear_overlap.check_args(["--steps", 0], 2)
    assert linear_overlap.check_args(["--seq", 256, "--hidden", 64], 4).seq == 256


def test_predicted_backward_against_values_worked_by_hand():
    """GPT-3's fc1 at t = 8 on a DGX H100, worked by hand: each GEMM 2 s b h (4h) / t =
    3.092e11 FLOPs at 989e12 x 0.51 FLOP/s = 0.6131 ms; each collective moves 7/8 of
    2048 x 12288 x 2 bytes = 44.04 MB at 450e9 x 0.8 B/s = 0.1223 ms, plus 7 x 10 us latency =
    0.1923 ms. Overlapped: max(0.1923, 0.6131) twice = 1.2262 ms; serial: the sum, 1.6108 ms."""
    from mpu_lab.perf.linear_overlap import format_predicted, predicted_backward
    r = predicted_backward(2048, 1, 12288, 8)
    assert abs(r["gemm_ms"] - 0.6131) < 1e-3 and abs(r["collective_ms"] - 0.1923) < 1e-3
    assert abs(r["modes"]["overlap"]["backward_ms"] - 1.2262) < 2e-3
    assert abs(r["modes"]["serial"]["backward_ms"] - 1.6108) < 2e-3
    assert "(24 % saved)" in format_predicted(r)
    with pytest.raises(ValueError, match="t = 16 spans more than one node of DGX H100"):
        predicted_backward(2048, 1, 12288, 16)
