"""The bad / remedy / good benchmark (mpu_lab.perf.bad_vs_good, launch/utilisation.py): its
configurations, how many ranks it runs, and the speed-up line, against values worked by hand.
The measured runs themselves are lab 15's and the script's business (timings, not tests)."""
import dataclasses
import importlib.util
import pathlib

import pytest

from mpu_lab.perf import bad_vs_good
from mpu_lab.perf.runs import ProfiledRun
from mpu_lab.perf.utilisation import Utilisation

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHAPE = dict(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=128,
             vocab_size=512, global_batch_size=16, train_iters=6)


def _script():
    spec = importlib.util.spec_from_file_location("utilisation_script",
                                                  ROOT / "launch" / "utilisation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(label, *rank_steps):
    reports = [dict(step_seconds=list(s), step_s=sum(s) / len(s)) for s in rank_steps]
    return ProfiledRun(label, len(reports), reports, Utilisation("clock", 0.05, [], {}, 2), [], 1.0)


def test_the_three_configurations_split_the_same_model_and_batch():
    configs = bad_vs_good.bad_vs_good_configs(2, **SHAPE)
    assert list(configs) == ["bad: PP=2, 1 micro-batch", "remedy: PP=2, 8 micro-batches",
                             "good: DP=2"]
    bad, remedy, good = configs.values()
    assert (bad.pp, bad.dp, bad.micro_batch_size) == (2, 1, 16)
    assert (remedy.pp, remedy.dp, remedy.micro_batch_size) == (2, 1, 2)
    assert (good.pp, good.dp, good.micro_batch_size) == (1, 2, 8)
    assert all(c.nproc == 2 and c.global_batch_size == 16 and c.num_layers == 8
               for c in configs.values())
    # the schedule's busy share by hand: m/(m+p-1) = 1/2, 8/9; DP: 1
    assert [bad_vs_good.schedule_busy_share(c) for c in configs.values()] == [0.5, 8 / 9, 1.0]
    # 12 sequences: 8 does not divide it, 6 does
    six = bad_vs_good.bad_vs_good_configs(2, **dict(SHAPE, global_batch_size=12))
    assert "remedy: PP=2, 6 micro-batches" in six


def test_the_profiled_runs_keep_the_split_and_three_iterations_at_most():
    configs = bad_vs_good.bad_vs_good_configs(2, **dict(SHAPE, train_iters=6))
    traced = bad_vs_good.for_profiling(configs)
    assert list(traced) == list(configs)
    for label, tc in traced.items():   # only the iteration count changes
        assert tc.train_iters == 3
        assert dataclasses.replace(tc, train_iters=6) == configs[label]
    short = bad_vs_good.bad_vs_good_configs(2, **dict(SHAPE, train_iters=2))
    assert [tc.train_iters for tc in bad_vs_good.for_profiling(short).values()] == [2, 2, 2]
    with pytest.raises(ValueError, match="at least 2 .* got 1"):
        bad_vs_good.for_profiling(configs, train_iters=1)


def test_bad_sizes_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="3 ranks must divide --num-layers 8 .* --global-batch-size 16"):
        bad_vs_good.bad_vs_good_configs(3, **SHAPE)
    with pytest.raises(ValueError, match="--global-batch-size 9 cannot be cut into 2 to 2 equal"):
        bad_vs_good.bad_vs_good_configs(3, **dict(SHAPE, num_layers=9, global_batch_size=9),
                                        microbatches=2)
    with pytest.raises(ValueError, match="the remedy needs at least 2 micro-batches, got 1"):
        bad_vs_good.bad_vs_good_configs(2, **SHAPE, microbatches=1)
    with pytest.raises(ValueError, match="at least 2 ranks, got 1"):
        bad_vs_good.timing_ranks(1, on_gpu=False)


def test_a_timing_job_gets_one_rank_per_core_and_says_so_otherwise():
    assert bad_vs_good.timing_ranks(2, on_gpu=False, cores=2) == (2, None)
    assert bad_vs_good.timing_ranks(8, on_gpu=True, cores=2) == (8, None)
    n, note = bad_vs_good.timing_ranks(8, on_gpu=False, cores=2)
    assert n == 2 and note.startswith("this machine has 2 usable CPU cores: a timing lesson runs "
                                      "one rank per core, so these jobs use 2 ranks, not 8")
    n, note = bad_vs_good.timing_ranks(4, on_gpu=False, cores=1)   # a pipeline needs 2
    assert n == 2 and "ranks share cores" in note


def test_speedups_use_each_runs_fastest_step_of_its_slowest_rank():
    # step i lasts as long as its slowest rank: bad steps max(1.0, 1.1) = 1.1 and
    # max(1.2, 0.9) = 1.2 -> fastest 1.1; remedy 0.5 -> 2.20 x; good 0.55 -> 2.00 x
    runs = {"bad: PP=2, 1 micro-batch": _run("bad", [1.0, 1.2], [1.1, 0.9]),
            "remedy: PP=2, 8 micro-batches": _run("remedy", [0.6, 0.5], [0.5, 0.5]),
            "good: DP=2": _run("good", [0.55, 0.7], [0.5, 0.7])}
    assert bad_vs_good.fastest_step_s(runs["bad: PP=2, 1 micro-batch"]) == 1.1
    assert bad_vs_good.speedup_line(runs) == \
        "speed-up over the bad configuration: remedy 2.20 x, good 2.00 x"
    text = bad_vs_good.format_steps(runs)
    assert text.splitlines()[0] == ("bad: PP=2, 1 micro-batch: fastest step 1100 ms, mean "
                                    "1100 ms over 2 timed steps")
    with pytest.raises(ValueError, match="no good run among"):
        bad_vs_good.speedups({k: v for k, v in runs.items() if not k.startswith("good")})
    with pytest.raises(ValueError, match="starts with one of bad, remedy, good"):
        bad_vs_good.role_of("fast: DP=2")


def test_the_script_refuses_bad_arguments_before_starting_anything(capsys):
    script = _script()
    for argv, message in ((["--nproc", "1"], "--nproc 1: a pipeline against data parallelism"),
                          (["--steps", "1"], "--steps 1: the first iteration is not timed"),
                          (["--heads", "3"], "--heads 3 must divide --hidden 256"),
                          (["--interval", "0"], "--interval must be > 0 seconds, got 0.0")):
        with pytest.raises(SystemExit):
            script.parse_args(argv)
        assert message in capsys.readouterr().err
    assert script.parse_args([]).microbatches == 8


def _stage_pair_s(timeline, stage=0):
    """One forward plus one backward of a micro-batch on ``stage`` (seconds)."""
    recs = timeline.records[stage]
    return sum(float(next(r[4] - r[3] for r in recs if r[0] == kind)) for kind in "FB")


def test_the_predicted_dgx_timelines_follow_the_schedule_worked_by_hand():
    timelines = bad_vs_good.predicted_bad_vs_remedy(8, 8)
    assert list(timelines) == ["bad: PP=8, 1 micro-batch", "remedy: PP=8, 8 micro-batches"]
    bad, remedy = timelines.values()
    # one micro-batch: the 8 stages run one after the other, forward down, backward up
    assert float(bad.makespan) == pytest.approx(8 * _stage_pair_s(bad), rel=1e-12)
    # 8 micro-batches through 8 stages: m + p - 1 = 15 forward-backward pairs of a stage
    assert float(remedy.makespan) == pytest.approx(15 * _stage_pair_s(remedy), rel=1e-12)
    # idle share (p-1)/(m+p-1): 7/8 and 7/15, exactly
    assert (str(bad.bubble_share), str(remedy.bubble_share)) == ("7/8", "7/15")
    # a micro-batch of 8 sequences costs 8 of 1 sequence (GEMMs and elementwise ops both
    # scale with the tokens), so the speed-up is the schedule's p m/(m+p-1) = 64/15
    assert _stage_pair_s(bad) == pytest.approx(8 * _stage_pair_s(remedy), rel=1e-9)
    assert bad_vs_good.predicted_speedup(timelines) == pytest.approx(64 / 15, rel=1e-9)
    # by hand, a floor: a stage's 3 layers' matmuls alone, forward + backward, at the H100's
    # 989 TFLOP/s peak: 3 * 6 * 12 h^2 s = 3 * 72 * 2048^2 * 2048 / 989e12 s = 1.88 ms
    assert 1.88e-3 < _stage_pair_s(remedy) < 50e-3


def test_the_prediction_is_printed_labelled_and_beside_the_measured_line():
    timelines = bad_vs_good.predicted_bad_vs_remedy(8, 8)
    lines = bad_vs_good.format_predicted(timelines).splitlines()
    assert max(map(len, lines)) <= 100
    assert lines[0].startswith("PREDICTED for a DGX H100 (GPT-3 XL (1.3 B), 8 sequences of 2048 "
                               "tokens per step")
    assert lines[2].startswith("  bad: PP=8, 1 micro-batch: step ")
    assert lines[2].endswith("each GPU busy 1/8 of it, idle 7/8")
    assert lines[3].endswith("each GPU busy 8/15 of it, idle 7/15")
    assert lines[4:] == ["predicted speed-up of the remedy over the bad configuration: 4.27 x",
                         "  (the schedule alone: p·m/(m+p-1) = 64/15 = 4.27)"]
    runs = {"bad: PP=2, 1 micro-batch": _run("bad", [1.1], [1.0]),
            "remedy: PP=2, 8 micro-batches": _run("remedy", [0.5], [0.4]),
            "good: DP=2": _run("good", [0.55], [0.5])}
    # measured: 1.1 / 0.5 = 2.20 x
    assert bad_vs_good.measured_vs_predicted_line(runs, timelines) == (
        "remedy's speed-up over the bad configuration:\n"
        "  measured here (PP=2, 8 micro-batches) 2.20 x\n"
        "  PREDICTED for a DGX H100 (PP=8, 8 micro-batches) 4.27 x")


def test_bad_predicted_sizes_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="divide the model's 24 layers, got 5"):
        bad_vs_good.predicted_bad_vs_remedy(5, 8)
    with pytest.raises(ValueError, match="at least 2 micro-batches of at least 1 sequence, got 1 of 1"):
        bad_vs_good.predicted_bad_vs_remedy(8, 1)
    timelines = bad_vs_good.predicted_bad_vs_remedy(4, 8)
    only_bad = {"bad: PP=4, 1 micro-batch": timelines["bad: PP=4, 1 micro-batch"]}
    with pytest.raises(ValueError, match="no remedy timeline"):
        bad_vs_good.predicted_speedup(only_bad)


def test_saved_runs_load_back_with_ranks_as_keys_and_the_same_verdict(tmp_path):
    # What launch/utilisation.py writes for lab 15's pictures: a run with per-rank tables keyed by
    # rank (JSON makes them strings) and a cropped window comes back equal, field by field.
    util = Utilisation("clock", 0.05, [0.0, 0.05, 0.1], {0: [100.0, 50.0, 0.0], 1: [0.0, 100.0, 100.0]},
                       2, machine=[90.0, 80.0, 70.0], clock_times=[0.0, 0.1],
                       cpu_seconds={0: [0.0, 0.08], 1: [0.0, 0.1]}, pinned={0: 0, 1: 1}, window=(0.0, 0.1))
    runs = {"bad: PP=2, 1 micro-batch": ProfiledRun("bad", 2, [dict(step_seconds=[1.1], step_s=1.1)],
                                                     util, [{"iteration": 1, "lm_loss": 6.2}], 3.5),
            "remedy: PP=2, 8 micro-batches": _run("remedy", [0.5], [0.4]),
            "good: DP=2": _run("good", [0.55], [0.5])}
    path = bad_vs_good.save_runs(runs, tmp_path / "bad_vs_good.json")
    back = bad_vs_good.load_runs(path)
    assert back == runs
    assert back["bad: PP=2, 1 micro-batch"].utilisation.values[1] == [0.0, 100.0, 100.0]
    assert bad_vs_good.speedup_line(back) == bad_vs_good.speedup_line(runs)


def test_gpu_sized_runs_are_refused_on_cpu_ranks_before_anything_starts():
    from mpu_lab.perf import bad_vs_good
    # L=4, h=8, a=2, s=4, V=16, p=2, micro-batch 2, by hand: a layer 2(4h^2 + 2h*4h) + 4sh
    # = 1,664 FLOP per token; a stage 2 layers + logits 2hV with V padded to 128 (Megatron's
    # rule, as train_gpt.py pads it) = 3,328 + 2,048 = 5,376; forward and backward (x3) of
    # 2 x 4 tokens: 129,024
    configs = bad_vs_good.bad_vs_good_configs(2, 4, 8, 2, 4, 16, 4, 3, microbatches=2)
    bad, remedy, good = configs.values()
    assert (bad.pp, bad.micro_batch_size, remedy.micro_batch_size) == (2, 4, 2)
    assert bad_vs_good.longest_wait_flops(remedy) == 129_024
    assert bad_vs_good.longest_wait_flops(bad) == 2 * 129_024
    assert bad_vs_good.longest_wait_flops(good) == 0
    # at 2,000 FLOP/s the bad run's rank would wait 129 s: past the 60 s default, not 300 s
    with pytest.raises(ValueError) as err:
        bad_vs_good.refuse_past_timeout(configs, ["--bf16"], env={}, flops_per_s=2000.0)
    text = str(err.value)
    assert text.startswith("bad: PP=2, 1 micro-batch would keep a rank waiting about 129 s")
    for shown in ("timeout of 60 s", "layers=4", "hidden=8", "seq_length=4", "global_batch=4",
                  "bfloat16", "profile='cpu'", "MPU_LAB_TIMEOUT_S"):
        assert shown in text, shown
    bad_vs_good.refuse_past_timeout(configs, [], env={"MPU_LAB_TIMEOUT_S": "300"},
                                    flops_per_s=2000.0)
    bad_vs_good.refuse_past_timeout({"good": good}, [], env={}, flops_per_s=1.0)
