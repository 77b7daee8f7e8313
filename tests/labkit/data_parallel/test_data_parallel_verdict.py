"""Lab 04's overlap verdict: the parts it prints add up to the step, and the verdict follows
from the printed step times with the stated relative tolerance (worked by hand)."""
from mpu_lab.labkit.data_parallel import lessons
from mpu_lab.perf.dp_overlap import DPOverlapResult


def _result(off, on):
    # off / on: (step, backward, exposed) ms of a single step on each of 2 ranks
    rec = lambda s, b, e: dict(steps=[dict(step_ms=s, backward_ms=b, exposed_ms=e)])  # noqa
    return DPOverlapResult(d=2, modes=["all-reduce", "all-reduce + overlap"], bucket_size=1,
                           train_argv=[], wall_s=0.0,
                           reports=[{"device": "cpu", "core": k,
                                     "modes": {"all-reduce": rec(*off),
                                               "all-reduce + overlap": rec(*on)}}
                                    for k in range(2)])


def test_parts_add_up_and_the_verdict_uses_a_relative_tolerance(capsys):
    # 13 ms -> 9 ms: backward 2 -> 4, exposed 2 -> 1, so the rest is 9 -> 4 ms; 9/13 - 1 = -31 %
    row, = lessons.overlap_parts(_result((13, 2, 2), (9, 4, 1)))
    assert row["off"] == dict(step=13, backward=2, exposed=2, rest=9)
    assert row["on"] == dict(step=9, backward=4, exposed=1, rest=4)
    assert lessons.overlap_verdict(row["change"]) == "a saving of 31 %"
    assert lessons.overlap_verdict(0.04) == "no difference (within 5 %)"
    assert lessons.overlap_verdict(0.06) == "a loss of 6 %"
    lessons.print_overlap_verdict(_result((100, 50, 20), (98, 55, 10)))
    out = capsys.readouterr().out
    assert "step 100.0 -> 98.0 ms with overlap: no difference (within 5 %)" in out
    assert "this machine shows no clear saving" in out
    # exposed 20 -> 10 ms, backward 50 -> 55 ms (by hand)
    assert "overlap took 10.0 ms off the exposed time and added 5.0 ms to backward" in out
    assert max(len(line) for line in out.splitlines()) <= 100
