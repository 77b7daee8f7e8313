"""The step timer of ``train_gpt.py --breakdown`` (mpu_lab.perf.breakdown.StepTimer) as a
callback of the real training loop, in a one-rank gloo world with a tiny GPT: it times the
steps after the skipped ones, each inside the iteration time the loop itself logs, and
``time_step`` books nothing, and leaves no collective timer open, when the step raises.
(The timer's bookkeeping of collectives is tested in test_comm_timing.py, its breakdown of
real multi-rank runs in test_perf_measure.py.)"""
import pytest
import torch

from mpu_lab import training
from mpu_lab.core import comm
from mpu_lab.perf import breakdown

TINY = ["--num-layers", 1, "--hidden-size", 16, "--num-attention-heads", 2, "--seq-length", 8,
        "--micro-batch-size", 2, "--vocab-size", 32, "--make-vocab-size-divisible-by", 16,
        "--train-iters", 4, "--log-interval", 1, "--quiet"]


def test_the_step_timer_times_each_step_inside_the_loops_own_iteration_time(world):
    args = training.validate_args(training.parse_args([str(a) for a in TINY]), 1)
    state = training.setup(args, log=lambda s: None)
    timer = breakdown.StepTimer(skip=1)
    metrics = training.train(state, log=lambda s: None, callbacks=[timer])
    assert len(timer.step_seconds) == 3                     # 4 steps, the first not timed
    # the loop's iteration time (log interval 1) holds the step and its callbacks
    for timed, logged in zip(timer.step_seconds, metrics[1:]):
        assert 0 < timed <= logged["iteration_time_s"]
    report = timer.report()
    assert report["steps"] == 3 and report["step_s"] == pytest.approx(sum(timer.step_seconds) / 3)
    assert report["window"][0] < report["window"][1]


def test_time_step_books_nothing_when_the_step_raises(world):
    timer = breakdown.StepTimer(skip=0)

    def failing_step():
        comm.all_reduce(torch.ones(2))
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        timer.time_step(failing_step)
    booked = len(timer.comm_timer.calls)
    comm.all_reduce(torch.ones(2))                          # after the step: not timed
    assert timer.step_seconds == [] and len(timer.comm_timer.calls) == booked
    assert timer.time_step(lambda: 7) == 7 and len(timer.step_seconds) == 1
