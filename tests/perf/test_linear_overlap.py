"""What Megatron's linear does in backward, read from a recorded timeline (mpu_lab.perf.
linear_overlap): which GEMM ran while which collective was in flight, and bad sizes refused
before anything starts. The real run is lab 07's 'Going further' section (nbval)."""
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
