"""Lab 11's bubble verdict: agreement judged with a relative tolerance, from the printed numbers
(issue 38 item 2: 0.19 against 0.11 is not agreement, though it is within 0.1)."""
from mpu_lab.labkit.pipeline_parallel import lessons
from mpu_lab.perf.pipeline_bubble import BubbleMeasurement, BubbleRun


def _measurement(*rows):
    runs = [BubbleRun(m, (2 - 1) / (m + 2 - 1), [hooks], [cpu], []) for m, hooks, cpu in rows]
    return BubbleMeasurement(2, runs, cores=[0, 1], cores_available=2)


def test_relative_tolerance_tells_0_19_from_0_11():
    assert not lessons.agrees(0.19, 1 / 9)           # +71 %: within 0.1 absolute, not 25 %
    assert lessons.agrees(0.12, 1 / 9)               # +8 %
    assert lessons.agrees(0.55, 0.5) and not lessons.agrees(0.30, 0.5)


def test_verdicts_follow_the_printed_numbers_and_say_why_they_differ():
    text = lessons.bubble_verdicts(_measurement((1, 0.51, 0.52), (8, 0.19, 0.40)))
    rows = text.splitlines()
    rows = rows[next(i for i, r in enumerate(rows) if r.lstrip().startswith("m  (p-1)")) - 1:]
    assert rows[2].split()[:2] == ["1", "0.50"] and rows[2].endswith("yes")
    # m = 8: (p-1)/(m+p-1) = 1/9 = 0.11; 0.19 is 71 % above it
    assert rows[3].split()[:5] == ["8", "0.11", "0.19", "0.40", "+71%"]
    assert rows[3].endswith("no: they differ")
    assert "Above the formula" in text and "CPU-time share is larger" in text
    assert "Below the formula" not in text
    assert all(len(line) <= 100 for line in text.splitlines())


def test_a_measurement_below_the_formula_is_not_explained_by_overheads():
    text = lessons.bubble_verdicts(_measurement((8, 0.05, 0.05)))
    assert "Below the formula" in text and "Above the formula" not in text
