"""Measurement tools (mpu_lab.perf: bandwidth, breakdown, utilisation, runs): the nccl-tests
bandwidth formulas, the step-time breakdown of real train_gpt runs, the utilisation sampler and
the bandwidth benchmark."""
import math

import pytest

from mpu_lab.perf import bandwidth, breakdown, runs, utilisation


# --------------------------------------------------------------------------- formulas
def test_busbw_factors_are_the_nccl_tests_ones_by_hand():
    # nccl-tests doc/PERFORMANCE.md: all-reduce 2(n-1)/n, all-gather and reduce-scatter
    # (n-1)/n, broadcast 1. By hand for n = 8: 14/8, 7/8, 7/8, 1.
    assert bandwidth.bus_factor("all_reduce", 8) == 1.75
    assert bandwidth.bus_factor("all_gather", 8) == 0.875
    assert bandwidth.bus_factor("reduce_scatter", 8) == 0.875
    assert bandwidth.bus_factor("broadcast", 8) == 1.0
    assert bandwidth.bus_factor("all_reduce", 1) == 0.0      # nothing crosses a link
    # 1 GB all-reduced over 4 ranks in 10 ms: algbw 100 GB/s, busbw 150 GB/s.
    assert bandwidth.algbw(1e9, 0.01) == pytest.approx(100e9)
    assert bandwidth.busbw("all_reduce", 1e9, 0.01, 4) == pytest.approx(150e9)
    assert bandwidth.busbw("all_gather", 2 ** 20, 2 ** -10, 2) == pytest.approx(2 ** 29)


@pytest.mark.parametrize("call,message", [
    (lambda: bandwidth.bus_factor("alltoall", 4), "unknown collective 'alltoall'"),
    (lambda: bandwidth.bus_factor("all_reduce", 0), "integer >= 1"),
    (lambda: bandwidth.algbw(1024, 0.0), "time must be > 0"),
    (lambda: bandwidth.parse_size("12Q"), "not a byte count"),
    (lambda: bandwidth.message_sizes("1M", "1K"), "larger than the maximum"),
])
def test_bad_bandwidth_inputs_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_sizes_and_tensor_shapes_of_the_benchmark():
    assert bandwidth.parse_size("64K") == 65536 and bandwidth.parse_size("1m") == 2 ** 20
    assert bandwidth.message_sizes("1K", "16K", 4) == [1024, 4096, 16384]
    assert bandwidth.message_sizes(1000, 3000) == [1000, 2000]
    # S = 1000 bytes of fp32 = 250 elements; over 3 ranks all-gather sends 83 each (S = 249).
    assert bandwidth.collective_numel("all_gather", 1000, 3, 4) == (83, 996)
    assert bandwidth.collective_numel("reduce_scatter", 1000, 3, 4) == (249, 996)
    assert bandwidth.collective_numel("all_reduce", 1000, 3, 4) == (250, 1000)
    assert bandwidth.collective_numel("broadcast", 2, 3, 4) == (1, 4)


def test_categories_follow_the_group_and_the_size():
    families = {"tp": [0, 1], "dp": [0, 2], "pp": [0, 4]}
    cat = breakdown.categorize
    assert cat("all_reduce", (0, 1), 4096, families) == "tp all_reduce"       # a layer's output
    assert cat("all_reduce", (0, 2), 30080, families) == "dp all_reduce"      # the gradients
    assert cat("p2p", (0, 4), 4096, families) == "pp p2p"
    assert cat("all_reduce", (0, 1), 1, families) == "other"      # one number: the grad norm
    assert cat("broadcast", (0, 4), 1, families) == "other"       # the loss for the log line
    assert cat("all_reduce", (0, 4), 4096, families) == "other"   # tied embedding: no family
    assert cat("all_reduce", (0, 1, 2, 3), 4096, families) == "other"
    # tp and dp groups with the same ranks are one group: tp wins
    assert cat("all_gather", (0, 1), 64, {"tp": [0, 1], "dp": [0, 1]}) == "tp all_gather"


# --------------------------------------------------------------------------- the 4-rank job
@pytest.fixture(scope="module")
def traces(four_rank_job):
    return four_rank_job[2]


@pytest.fixture(scope="module")
def job(four_rank_job):
    """Each rank's dict from tests/mp/perf_checks.py's measurements, run in the shared 4-rank
    job (tests/mp/four_rank_checks.py; ``four_rank_job`` in conftest.py), with the ranks' CPU
    use sampled while it ran."""
    return [rep["perf"] for rep in four_rank_job[0]], four_rank_job[3], four_rank_job[4]


CONFIGS = {
    # name: (categories that must appear, categories that must not)
    "tp2_pp2": ({"compute", "tp all_reduce", "tp broadcast", "pp p2p"},
                {"dp all_reduce", "tp all_gather", "tp reduce_scatter", "wait (barrier)"}),
    "dp4_barrier": ({"compute", "dp all_reduce", "wait (barrier)"},
                    {"tp all_reduce", "tp broadcast", "pp p2p"}),
    "tp4_sp": ({"compute", "tp all_gather", "tp reduce_scatter", "tp broadcast"},
               {"dp all_reduce", "pp p2p", "wait (barrier)"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_breakdown_has_the_collectives_of_its_layout(job, name):
    must, must_not = CONFIGS[name]
    for rank, report in enumerate(job[0]):
        parts = report[name]["breakdown"]["parts"]
        assert must <= set(parts), (rank, sorted(parts))
        assert not must_not & set(parts), (rank, sorted(parts))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_breakdown_parts_are_non_negative_and_match_the_trainers_own_step_time(job, name):
    for rank, report in enumerate(job[0]):
        b, metrics = report[name]["breakdown"], report[name]["metrics"]
        assert b["steps"] == len(metrics) - 1 == 2          # the first step is not timed
        assert all(v >= 0 for v in b["parts"].values()), b["parts"]
        assert sum(b["parts"].values()) == pytest.approx(b["step_s"], rel=1e-9)
        # train() clocks each logged iteration itself (log interval 1): same steps, other clock
        trainer = sum(m["iteration_time_s"] for m in metrics[1:]) / (len(metrics) - 1)
        assert b["step_s"] == pytest.approx(trainer, rel=0.2, abs=0.003), (b["step_s"], trainer)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_counted_collective_is_timed(job, name):
    for report in job[0]:
        calls = report[name]["breakdown"]["calls"]
        timed = sum(v for k, v in calls.items() if k != "pp p2p")
        assert timed == pytest.approx(report[name]["counted_collectives_per_step"])


@pytest.mark.slow
def test_breakdown_profile_writes_a_trace_per_rank_and_names_the_top_ops(job, traces):
    import json
    for rank, report in enumerate(job[0]):
        profile = report["tp2_pp2"]["breakdown"]["profile"]
        assert profile["trace"] == str(traces / f"rank{rank}.trace.json")
        assert json.loads((traces / f"rank{rank}.trace.json").read_text())["traceEvents"]
        names = [op["name"] for op in profile["top_ops"]]
        assert len(names) == 12 and any(n.startswith("aten::") for n in names), names
        assert all(op["self_ms"] >= 0 and op["calls"] > 0 for op in profile["top_ops"])
    assert "profile" not in job[0][0]["dp4_barrier"]["breakdown"]


@pytest.mark.slow
def test_breakdown_coordinates_follow_the_layout(job):
    coords = [(r["tp2_pp2"]["breakdown"]["tp_rank"], r["tp2_pp2"]["breakdown"]["pp_rank"])
              for r in job[0]]
    assert coords == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [r["dp4_barrier"]["breakdown"]["dp_rank"] for r in job[0]] == [0, 1, 2, 3]


@pytest.mark.slow
def test_sampler_saw_every_rank_busy(job):
    util = job[1]
    assert util.kind == "cpu" and sorted(util.values) == [0, 1, 2, 3]
    assert len(util.machine) == len(util.times) > 20
    for rank, values in util.values.items():
        assert len(values) == len(util.times)
        seen = [v for v in values if not math.isnan(v)]
        assert len(seen) > 10 and min(seen) >= 0 and max(seen) > 20, (rank, seen[:10])
    window = util.crop(util.times[5], util.times[10])
    assert len(window.times) == 6 and all(len(v) == 6 for v in window.values.values())
    runnable = job[2]
    assert runnable.kind == "runnable" and sorted(runnable.values) == [0, 1, 2, 3]
    for rank, values in runnable.values.items():
        seen = [v for v in values if not math.isnan(v)]
        assert set(seen) <= {0.0, 100.0} and seen.count(100.0) > 5, (rank, seen[:20])


@pytest.mark.slow
def test_bandwidth_benchmark_rows(job):
    rows = job[0][0]["bandwidth"]
    assert [(r["op"], r["size_bytes"]) for r in rows] == [
        (op, size) for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
        for size in (1024, 4096)]
    factor = {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "broadcast": 1.0}
    for r in rows:
        assert r["wrong"] == 0 and r["ranks"] == 4 and r["time_s"] > 0
        assert r["algbw"] == pytest.approx(r["size_bytes"] / r["time_s"])
        assert r["busbw"] == pytest.approx(r["algbw"] * factor[r["op"]])
    # every rank agrees on the averaged times
    assert all(rep["bandwidth"] == rows for rep in job[0])
    assert "busbw GB/s" in bandwidth.format_bandwidth(rows).splitlines()[0]


def test_sampler_refuses_a_gpu_it_cannot_find():
    if utilisation.UtilisationSampler(gpu="auto").kind == "gpu":    # NVML sees a GPU
        pytest.skip("a GPU is visible")
    with pytest.raises(ValueError, match="NVML finds no GPU"):
        utilisation.UtilisationSampler(gpu=True)
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        utilisation.UtilisationSampler(interval_s=0)


def _script(name):
    import importlib.util

    from mpu_lab.launcher import LAUNCH_DIR
    spec = importlib.util.spec_from_file_location(name, LAUNCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name,argv,message", [
    ("bench_bandwidth", ["--ops", "alltoall"], "unknown collective 'alltoall'"),
    ("bench_bandwidth", ["--min-bytes", "1M", "--max-bytes", "1K"], "larger than the maximum"),
    ("bench_bandwidth", ["--iters", "0"], "--iters"),
    ("utilisation", ["--nproc", "1"], "needs at least 2 ranks"),
    ("utilisation", ["--heads", "3"], "must divide --hidden"),
])
def test_benchmark_scripts_refuse_bad_flags_before_starting(name, argv, message, capsys):
    with pytest.raises(SystemExit):
        _script(name).parse_args(argv)
    assert message in capsys.readouterr().err


# --------------------------------------------------------------------------- lab helpers
def _report(rank, parts, calls=None, window=(10.0, 11.0)):
    step = sum(parts.values())
    return dict(rank=rank, steps=2, step_s=step, step_seconds=[step, step], parts=parts,
                calls=calls or {}, bytes={}, barrier=False, window=list(window), device="cpu",
                tp=1, pp=2, dp=1, tp_rank=0, pp_rank=rank, dp_rank=0)


def test_allreduce_fit_by_hand():
    # 4 ranks: 4 KiB in 1 ms, 16 KiB in 1.2 ms, 1 MiB in 11 ms -> latency 1 ms,
    # busbw = 2(4-1)/4 x 2^20 B / 10 ms = 1.5 x 104857600 B/s
    rows = [dict(op="all_reduce", size_bytes=s, ranks=4, time_s=t)
            for s, t in ((4096, 1e-3), (16384, 1.2e-3), (2 ** 20, 11e-3))]
    rows.append(dict(op="broadcast", size_bytes=4096, ranks=4, time_s=1e-6))   # ignored
    fit = bandwidth.allreduce_fit(rows)
    assert fit["latency_s"] == 1e-3 and fit["nproc"] == 4
    assert fit["busbw"] == pytest.approx(1.5 * 2 ** 20 / 0.01)
    with pytest.raises(ValueError, match="at least two sizes"):
        bandwidth.allreduce_fit(rows[:1])


def test_breakdown_table_window_and_model_comparison():
    reports = [_report(0, {"compute": 0.1, "pp p2p": 0.3}, {"pp p2p": 1}, (10.0, 12.0)),
               _report(1, {"compute": 0.3, "pp p2p": 0.05, "other": 0.05}, {"pp p2p": 1}, (10.5, 12.5))]
    assert breakdown.categories(reports) == ["compute", "pp p2p", "other"]
    table = breakdown.format_breakdown(reports).splitlines()
    assert len(table) == 3 and "75%" in table[1] and "pp p2p" in table[0]
    assert breakdown.training_window(reports) == (10.0, 12.5)
    with pytest.raises(ValueError, match="rank 1 reported no breakdown"):
        breakdown.breakdowns([{"breakdown": reports[0]}, {"metrics": []}])

    class Prediction:   # the fields of perf.cost_model.IterationPrediction that are compared
        total_s = 0.5

        def breakdown(self):
            return {"compute": 0.1, "tp_comm": 0.0, "pp_p2p": 0.02, "bubble": 0.3,
                    "dp_comm": 0.0, "optimizer": 0.01}

    util = utilisation.Utilisation("cpu", 0.1, [], {}, 2)
    run = runs.ProfiledRun("bad", 2, reports, util, [], 1.0)
    row = runs.measured_vs_predicted(run, Prediction())
    assert row["measured_s"] == pytest.approx(0.4) and row["ratio"] == pytest.approx(0.8)
    assert row["causes"]["pp_p2p+bubble"] == pytest.approx(dict(predicted_s=0.32, measured_s=0.3))
    assert row["causes"]["compute"] == pytest.approx(dict(predicted_s=0.11, measured_s=0.1))
    assert "bad" in runs.format_measured_vs_predicted([row])


def test_utilisation_mean_ignores_missing_samples_and_crop_keeps_the_window():
    nan = float("nan")
    util = utilisation.Utilisation("cpu", 0.1, [0.0, 0.1, 0.2, 0.3], {0: [nan, 50.0, 70.0, 30.0],
                                                                    1: [nan, nan, 20.0, 40.0]},
                               2, machine=[10.0, 60.0, 60.0, 40.0])
    assert util.mean() == {0: 50.0, 1: 30.0}
    part = util.crop(0.1, 0.25)
    assert part.times == [0.1, 0.2] and part.values[1][1] == 20.0 and part.machine == [60.0, 60.0]


def test_training_flags_of_a_train_config_leave_out_the_metrics_file():
    from mpu_lab.perf import calibrate
    flags = runs.training_flags(calibrate.TrainConfig(pp=2, num_layers=4))
    assert "--metrics-file" not in flags
    assert flags[flags.index("--pipeline-model-parallel-size") + 1] == "2"


@pytest.mark.parametrize("p,m", [(4, 1), (4, 8), (2, 3)])
def test_schedule_utilisation_is_busy_m_over_m_plus_p_minus_1(p, m):
    util = utilisation.schedule_utilisation("1f1b", p, m, iterations=2)
    # a perfect machine: every stage works 2m slots (m forwards, m backwards) of 2(m + p - 1)
    for rank, mean in util.mean().items():
        assert mean == pytest.approx(100 * m / (m + p - 1)), rank
    assert sorted(util.values) == list(range(p))


# --------------------------------------------------------------------------- lab 15 exercises
def test_lab08_checkers(capsys):
    from mpu_lab import perf
    from mpu_lab.labkit.performance import exercises
    # (p-1)/m <= 5 % with p = 8: m >= 7 / 0.05 = 140 (by hand)
    assert exercises.check_min_microbatches(140, p=8, max_bubble=0.05)
    assert not exercises.check_min_microbatches(139, p=8, max_bubble=0.05)
    assert not exercises.check_min_microbatches(None, p=8, max_bubble=0.05)
    # interleaved, v = 2: (4-1)/(2 m) <= 0.1 -> m >= 15
    assert exercises.check_min_microbatches(15, p=4, max_bubble=0.1, v=2)

    gpt13 = perf.ModelShape(24, 2048, 16, 2048, 51200)
    pure_dp = perf.ParallelConfig(tp=1, pp=1, dp=32, micro_batch_size=1, global_batch_size=512)
    # with t = p = 1 the data-parallel all-reduce is the only communication there is
    assert exercises.check_dominant_communication("data", gpt13, pure_dp, perf.DGX_A100_80GB)
    assert not exercises.check_dominant_communication("tp", gpt13, pure_dp, perf.DGX_A100_80GB)

    gpt39 = perf.ModelShape(48, 8192, 64, 2048, 51200)
    cluster = perf.DGX_A100_80GB.replace(num_nodes=8)
    accepted = best_pairs_by_brute_force(gpt39, cluster, 64, 512, tol=0.05)
    # Pinned: t=4, p=4 is fastest; (2, 8), (4, 8) and (8, 2) are within 5 % of it, (8, 4) is not.
    assert accepted == {(4, 4), (2, 8), (4, 8), (8, 2)}
    for t in (1, 2, 4, 8, 16, 32, 64):
        for p in (1, 2, 3, 4, 6, 8, 12, 16, 24, 48):
            assert bool(exercises.check_best_config((t, p), gpt39, cluster, 64, 512)) == \
                ((t, p) in accepted), (t, p)
    assert not exercises.check_best_config((16, 4), gpt39, cluster, 64, 512)   # TP across boxes
    assert not exercises.check_best_config((3, 3), gpt39, cluster, 64, 512)    # not valid
    assert not exercises.check_best_config("8,2", gpt39, cluster, 64, 512)
    out = capsys.readouterr().out
    assert "No answer yet" in out and "not a valid (t, p)" in out
    # the second wrong answer to the same question shows the fastest pair (pinned above: t=4,
    # p=4), not the learner's own
    assert "The answer, after" in out and "the fastest is t=4, p=4" in out


def best_pairs_by_brute_force(model, cluster, num_gpus, batch, tol):
    """The (t, p) pairs whose best micro-batch size fits in memory and is predicted within
    ``tol`` of the fastest fitting configuration — found without the explorer: the valid splits
    are spelled out here (t divides the heads and the ffn size, p divides the layers,
    d = N / (t p), b in (1, 2, 4, 8) with B a multiple of b d; sequence parallelism wherever
    t > 1; selective recomputation, as explore()'s defaults), each is predicted by the cost
    model, and the ranking rule is: fitting configurations only, least seconds per iteration."""
    from mpu_lab import perf
    ffn = 4 * model.hidden_size
    best_of_pair = {}
    for t in range(1, num_gpus + 1):
        for p in range(1, num_gpus // t + 1):
            if num_gpus % (t * p) or model.num_attention_heads % t or ffn % t \
                    or model.num_layers % p:
                continue
            d = num_gpus // (t * p)
            for b in (1, 2, 4, 8):
                if batch % (b * d):
                    continue
                cfg = perf.ParallelConfig(tp=t, pp=p, dp=d, micro_batch_size=b,
                                          global_batch_size=batch, sequence_parallel=t > 1,
                                          recompute="selective")
                pred = perf.predict_iteration(model, cfg, cluster)
                if pred.fits:
                    best_of_pair[t, p] = min(best_of_pair.get((t, p), math.inf), pred.total_s)
    fastest = min(best_of_pair.values())
    return {pair for pair, secs in best_of_pair.items() if secs <= (1 + tol) * fastest}


def test_lab08_figures_draw_what_they_are_given():
    from mpu_lab import perf
    from mpu_lab.labkit.performance import viz
    from mpu_lab.labkit.scaling import viz as scaling_viz
    util = {f"m={m}": utilisation.schedule_utilisation("1f1b", 4, m) for m in (1, 8)}
    fig = viz.plot_utilisation(util, xlabel="slots")
    assert len(fig.axes) == 3                                      # two panels and a colorbar
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()][0] == "rank 0 (25%)"

    reports = [_report(r, {"compute": 0.1, "pp p2p": 0.2 - 0.05 * r}) for r in range(2)]
    fig = viz.plot_step_breakdown({"a": reports, "b": reports})
    assert len(fig.axes) == 2 and len(fig.axes[0].patches) == 2 * 2   # 2 categories x 2 ranks

    rows = [dict(op=op, size_bytes=s, busbw=1e9) for op in ("all_reduce", "broadcast")
            for s in (1024, 4096)]
    assert len(viz.plot_bandwidth(rows).axes[0].lines) == 2

    model = perf.ModelShape(8, 512, 8, 256, 1024)
    result = perf.explore(model, perf.DGX_A100_80GB, num_gpus=8, global_batch_size=32)
    pairs = {(c.config.tp, c.config.pp) for c in result.candidates}
    assert len(scaling_viz.plot_exploration(result).axes[0].get_yticklabels()) == len(pairs)

    published = [dict(name=f"run {i}", gpus=8, gpu="a100", reported_tflops=100.0,
                      predicted_tflops=100.0 + i, error=i / 100, calibration=i == 0)
                 for i in range(3)]
    fig = scaling_viz.plot_published_runs(published)
    assert len(fig.axes) == 2 and len(fig.axes[0].get_yticklabels()) == 3
