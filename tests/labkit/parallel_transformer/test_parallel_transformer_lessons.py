"""Lab 09's overlap verdict follows from the step times (worked by hand)."""
from mpu_lab.labkit.parallel_transformer import lessons


def _reports(pairs, device="cpu"):
    return [dict(rank=k, device=device,
                 modes=dict(overlap=dict(step_ms=o), serial=dict(step_ms=s)))
            for k, (o, s) in enumerate(pairs)]


def test_the_verdict_is_computed_from_the_printed_times():
    # 78 / 100 and 70 / 100: 22 % and 30 % saved, but 2 ranks on 2 cores: not the GPU's overlap
    line = lessons.overlap_verdict(_reports([(78, 100), (70, 100)]), cores=2)
    assert "every rank saved at least 22 % (+22 %, +30 %)" in line
    assert "not the GPU's overlap" in line
    line = lessons.overlap_verdict(_reports([(37, 41), (39.4, 38.7)]), cores=2)
    assert "no saving on every rank beyond 5 % (+10 %, -2 %)" in line
    line = lessons.overlap_verdict(_reports([(110, 100), (120, 100)], device="cuda"), cores=2)
    assert line == ("Measured with 2 ranks on 2 cores: every rank was slower overlapped "
                    "(-10 %, -20 %).")
