"""Lab 12's support code without a world: the B/W split of one layer against torch's own
linear and a hand count of its FLOPs; the unit-clock reading of a timeline file against the
zero-bubble paper's figures; the memory each schedule holds against hand-worked values; the
timing report's verdict computed from the numbers it prints; the chart."""
import json
from fractions import Fraction

import pytest

from mpu_lab.core.pipeline_parallel.action_lists import Action
from mpu_lab.labkit.zero_bubble import split, timelines, timing, viz


def test_the_split_gives_the_whole_backward_and_one_gemm_each():
    r = split.split_one_layer(tokens=8, in_features=4, out_features=6)
    gemm = 2 * 8 * 4 * 6                       # hand count: one [8,6] x [6,4] product
    assert (r.whole_flops, r.b_flops, r.w_flops) == (2 * gemm, gemm, gemm)
    assert r.queued == 1 and r.input_grad_after_b and not r.weight_grad_after_b
    assert r.input_grad_equal and r.weight_grad_equal
    assert all(len(line) <= 100 for line in r.report().splitlines())


def test_the_split_refuses_bad_sizes():
    with pytest.raises(ValueError, match="tokens must be a positive integer, got 0"):
        split.split_one_layer(tokens=0)


@pytest.mark.parametrize("p", [2, 4])
def test_a_timeline_file_on_the_unit_clock_meets_the_papers_figures(tmp_path, p):
    """A file in --timeline-file's format (written here from the planned lists) read back:
    1F1B 3(p - 1), ZB-H1 p - 1 idle slots per rank (Qi et al. 2024, §3)."""
    m = 2 * p
    for name, per_rank in (("1F1B", 3 * (p - 1)), ("ZBH1", p - 1), ("ZBVZeroBubble", p - 1)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({str(r): [list(a) for a in acts] for r, acts in
                                    timelines.planned(name, p, m).items()}))
        ran = timelines.read_timeline(path)
        assert ran == timelines.planned(name, p, m)
        assert timelines.idle_of(timelines.unit_clock(ran, name)) == [per_rank] * p


def test_peak_in_flight_hand_worked():
    # 1F1B at p = 4: p - r on rank r; ZB-H1: p on every rank (rank r holds r Ws back);
    # ZB-V: p stages' worth (2p chunk forwards of half a stage)
    assert timelines.peak_in_flight(timelines.planned("1F1B", 4, 8), "1F1B") == [4, 3, 2, 1]
    assert timelines.peak_in_flight(timelines.planned("ZBH1", 4, 8), "ZBH1") == [4] * 4
    assert timelines.peak_in_flight(timelines.planned("ZBVZeroBubble", 4, 8),
                                    "ZBVZeroBubble") == [4] * 4
    one = {0: [Action("F", 0, 0), Action("F", 1, 0), Action("B", 0, 0), Action("W", 0, 0),
               Action("B", 1, 0), Action("W", 1, 0)]}
    assert timelines.peak_in_flight(one, "ZBH1") == [2]
    assert timelines.peak_in_flight(one, "ZBVZeroBubble") == [Fraction(1)]
    assert timelines.text(one[0]) == "F0 F1 B0 W0 B1 W1"


def test_run_timeline_refuses_an_unknown_schedule():
    with pytest.raises(ValueError, match="schedule 'GPipe'"):
        timelines.run_timeline("GPipe", 2, 4)


def _timing(measured, kind_s, load=0.5):
    return timing.Timing(2, 4, measured, {s: [v] for s, v in measured.items()}, kind_s,
                         [0, 1], 2, load)


def test_the_timing_shares_and_verdicts():
    unit = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0}
    t = _timing({"1F1B": 0.21, "ZBH1": 0.09}, unit)
    # p = 2, m = 4: 1F1B idles 3 of 15 slots per rank, ZB-H1 1 of 13
    assert t.unit_share("1F1B") == pytest.approx(3 / 15)
    assert t.unit_share("ZBH1") == pytest.approx(1 / 13)
    assert t.time_share("ZBH1") == pytest.approx(1 / 13)
    assert "Verdict: ZB-H1 idles less than 1F1B here" in t.report()
    lazy_w = _timing({"1F1B": 0.5, "ZBH1": 0.5}, {"F": 1.0, "B": 1.0, "W": 0.5, "BW": 1.5},
                     load=9.0)
    report = lazy_w.report()
    assert lazy_w.time_share("ZBH1") > lazy_w.unit_share("ZBH1")    # a short W fills less
    assert "did NOT show the gap" in report and "load average 9.0" in report
    assert "W takes 0.50 of B's time" in report
    assert all(len(line) <= 100 for line in report.splitlines())


def test_measure_refuses_bad_sizes():
    with pytest.raises(ValueError, match="pp=1"):
        timing.measure(1)


def test_the_chart_has_a_row_per_rank():
    placed = timelines.unit_clock(timelines.planned("ZBH1", 2, 4), "ZBH1")
    fig = viz.plot_stack({"ZB-H1": placed})
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["rank 1", "rank 0"]
