"""The bubble measured per rank (mpu_lab.perf.pipeline_bubble, launch/pipeline_bubble.py) and
predicted for a DGX H100. References: shares worked by hand from made-up clocks, the formula
(p-1)/(m+p-1) as a fraction, and the cost model's own per-micro-batch time."""
import os
from fractions import Fraction

import pytest

from mpu_lab.perf import pipeline_bubble as pb
from mpu_lab.perf.cost_model import DGX_H100, ParallelConfig, predict_iteration
from mpu_lab.perf.pipeline_order import schedule_order


def test_idle_share_is_one_minus_total_busy_over_total_wall():
    ranks = [{"wall_s": [2.0, 4.0], "busy_s": [1.0, 3.0]},
             {"wall_s": [2.0, 4.0], "busy_s": [1.5, 1.0]}]
    # iteration 0: 1 - 2.5/4 = 0.375; iteration 1: 1 - 4/8 = 0.5
    assert pb.idle_share(ranks, "busy_s") == [0.375, 0.5]


def _measurement(cores, available, hooks, cpu, devices=("cpu", "cpu")):
    runs = [pb.BubbleRun(1, 0.5, hooks[0], cpu[0] if cpu else None, []),
            pb.BubbleRun(8, 1 / 9, hooks[1], cpu[1] if cpu else None, [])]
    return pb.BubbleMeasurement(2, runs, cores, available, list(devices))


def test_summary_rows_say_whether_each_share_is_within_the_tolerance():
    m = _measurement([0, 1], 2, [[0.52, 0.55, 0.61], [0.40, 0.15, 0.18]],
                     [[0.53, 0.56, 0.6], [0.2, 0.2, 0.2]])
    lines = m.summary().splitlines()
    assert "cores 0, 1" in lines[0] and "2 core(s)." in lines[0]
    assert lines[2].split() == ["1", "0.50", "0.55", "0.56", "yes"]     # medians
    assert lines[3].split() == ["8", "0.11", "0.18", "0.20", "yes"]
    assert len(lines) == 4 and not m.oversubscribed and m.placement == "one core per stage"


def test_summary_flags_more_ranks_than_cores_and_a_busy_machine():
    m = _measurement([0, 0], 1, [[0.5], [0.4]], [[0.8], [0.8]])
    text = m.summary()
    assert m.oversubscribed and "MORE RANKS THAN CORES" in text
    assert m.placement == "2 stages on 1 core(s)"
    assert "NO" in text.splitlines()[3]
    assert "off its core" in text.splitlines()[-1]


def test_summary_on_gpus_has_no_cpu_time_column():
    m = _measurement([None, None], 16, [[0.5], [0.12]], None, ("cuda:0", "cuda:1"))
    assert "one GPU each (cuda:0, cuda:1)." in m.summary()
    assert m.summary().splitlines()[2].split()[3] == "-"
    assert not m.oversubscribed and m.placement == "one GPU per stage"


def test_summary_says_when_the_ranks_share_one_gpu():
    # the 1gpu profile: every rank on cuda:0 (gloo), so a waiting rank's GPU works for another
    m = _measurement([None, None], 16, [[0.5], [0.12]], None, ("cuda:0", "cuda:0"))
    head = m.summary().splitlines()[0]
    assert "one GPU each" not in head and "sharing 1 GPU (cuda:0)" in head
    assert "MORE RANKS THAN GPUS" in head and m.oversubscribed
    assert m.placement == "2 stages sharing 1 GPU"


def test_summary_on_an_unpinned_cpu_does_not_claim_gpus():
    m = _measurement([None, None], 2, [[0.5], [0.12]], [[0.5], [0.12]])
    assert "GPU" not in m.summary() and "not pinned" in m.summary()


@pytest.mark.parametrize("p,m", [(4, 8), (2, 1), (4, 2)])
def test_predicted_timeline_has_the_formulas_bubble_and_the_cost_models_time(p, m):
    t = pb.predicted_timeline(pb.GPT3_1_3B, p, m)
    assert t.bubble_share == Fraction(p - 1, m + p - 1)
    cfg = ParallelConfig(tp=1, pp=p, dp=1, micro_batch_size=1, global_batch_size=m)
    per_microbatch = predict_iteration(pb.GPT3_1_3B, cfg, DGX_H100).compute_s / m
    busy = sum(float(r[4] - r[3]) for r in t.records[0])
    assert busy == pytest.approx(m * per_microbatch, rel=1e-12)
    assert float(t.makespan) == pytest.approx((m + p - 1) * per_microbatch, rel=1e-12)


def test_predicted_interleaved_timeline_divides_the_bubble_by_v():
    t = pb.predicted_timeline(pb.GPT3_1_3B, 4, 8, schedule="interleaved", num_model_chunks=2)
    assert t.bubble_share == Fraction(3, 2 * 8 + 3)


def test_bad_sizes_are_refused_before_a_job_starts():
    with pytest.raises(ValueError, match="at least 2 pipeline stages, got 1"):
        pb.measure_bubble(1)
    with pytest.raises(ValueError, match=r"positive integers, got \[0\]"):
        pb.measure_bubble(2, (0,))


@pytest.fixture(scope="module")
def measured():
    return pb.measure_bubble(2, (1, 8), iterations=3, env={"MPU_LAB_BACKEND": "gloo"})


def test_live_run_pins_each_rank_to_its_own_core_and_runs_1f1b(measured):
    cores = len(os.sched_getaffinity(0))
    if cores >= 2:
        assert len(set(measured.cores)) == 2 and not measured.oversubscribed
    on_gpu = pb.torch.cuda.is_available()
    assert len(measured.devices) == 2 and all(d.startswith("cuda" if on_gpu else "cpu")
                                              for d in measured.devices)
    for run in measured.runs:
        for stage, recs in enumerate(run.records):
            ran = [(k, mb) for k, mb, _, _, _ in recs]
            assert ran == [(op.kind, op.microbatch)
                           for op in schedule_order("1f1b", 2, stage, run.num_microbatches)]
        assert all(0 <= s < 1 for s in run.from_hooks)


def test_live_bubble_is_within_a_tenth_of_the_formula_on_a_quiet_machine(measured):
    load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    if cores < 2 or load > cores:
        pytest.skip(f"load {load:.1f} on {cores} core(s): other processes take the cores, so the "
                    f"bubble cannot be measured here")
    for run in measured.runs:
        assert abs(run.measured - run.formula) <= 0.1, measured.summary()


@pytest.mark.parametrize("gpus,cores,ranks,fits", [(0, 2, 4, False), (0, 2, 2, True),
                                                   (8, 2, 8, True), (0, 16, 8, True),
                                                   (1, 16, 4, False), (2, 16, 4, False)])
def test_machine_note_says_whether_each_rank_has_a_processor(monkeypatch, gpus, cores, ranks, fits):
    monkeypatch.delenv("MPU_LAB_DEVICE", raising=False)
    monkeypatch.setattr(pb.torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(pb.rank_clock, "usable_cores", lambda: list(range(cores)))
    note = pb.machine_note(ranks)
    assert ("measured gaps are the bubble" in note) == fits
    assert ("PREDICTED for a DGX H100" in note) == (not fits)
    assert note.startswith(f"{ranks} ranks on {gpus or cores} ")
    # ranks sharing a GPU (the 1gpu profile) are said to share it, never to have a CPU or a GPU each
    assert ("share" in note and "no GPU" not in note) if gpus and not fits else True


def test_machine_note_says_when_other_processes_take_the_cores(monkeypatch):
    monkeypatch.delenv("MPU_LAB_DEVICE", raising=False)
    monkeypatch.setattr(pb.torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(pb.rank_clock, "usable_cores", lambda: [0, 1])
    monkeypatch.setattr(pb.os, "getloadavg", lambda: (5.6, 5.0, 4.0))
    assert pb.machine_note(2).endswith("\nBut the load average is 5.6 on 2 cores now: other "
                                       "processes take\nturns on them, and the gaps include "
                                       "those turns.")
    monkeypatch.setattr(pb.os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    assert pb.machine_note(2) == "2 ranks on 2 CPU cores: one each, so the measured gaps are the bubble."


def test_machine_note_follows_a_forced_cpu_device(monkeypatch):
    monkeypatch.setattr(pb.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(pb.rank_clock, "usable_cores", lambda: [0, 1])
    assert pb.machine_note(4, env={"MPU_LAB_DEVICE": "cpu"}).startswith("4 ranks on 2 CPU cores and no GPU")
