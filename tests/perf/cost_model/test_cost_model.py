"""The analytic cost model (mpu_lab.perf.cost_model), the configuration explorer (mpu_lab.perf.explorer)
and the published-runs check (mpu_lab/perf/published_runs.yaml, mpu_lab.perf.published_runs).

Expected values come from the papers (their closed forms and printed figures) or are worked out
by hand in the comments — never from the function under test."""
from fractions import Fraction

import pytest

from mpu_lab.perf import calibrate, explorer, published_runs
from mpu_lab.perf.cost_model import (
    DGX_A100_80GB, DGX_H100, ModelShape, ParallelConfig, bubble_fraction,
    dp_allreduce_bytes, hardware_flops_per_iteration, in_flight_microbatches, memory_per_gpu,
    model_flops_per_iteration, parameter_count, parameters_per_gpu, pipeline_p2p_bytes,
    predict_iteration, ring_all_reduce_factor, tp_comm_per_layer)

RUNS = published_runs.load_published_runs()
TABLE1 = [r for r in RUNS["runs"] if r["source"] == "narayanan2021"]
GPT3 = ModelShape(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048,
                  vocab_size=51200, name="GPT-3 175B")
GPT_1T = ModelShape(num_layers=128, hidden_size=25600, num_attention_heads=160,
                    seq_length=2048, vocab_size=51200)


# --------------------------------------------------------------------------- published runs
def test_one_efficiency_per_gpu_generation_predicts_every_published_run_within_15_percent():
    """The published-runs check. A100: fitted on the 1T run (the abstract's 502 PFLOP/s, 52 % of peak),
    held fixed for the nine other rows of Narayanan et al. 2021 Table 1. H100: docs/BENCHMARKS.md states
    two runs in words (GPT-3 175B at 96 and at 4608 GPUs, 47 % and 42 % MFU): the first only
    calibrates, the second is predicted. No per-run factor anywhere: the runs differ only in
    their published shape, split and batch."""
    rows = published_runs.published_runs_comparison({"a100": "GPT 1T", "h100": "GPT-3 175B (96 H100)"})
    assert len(rows) == len(RUNS["runs"]) == 12
    for gpu in ("a100", "h100"):
        assert len({r["efficiency"] for r in rows if r["gpu"] == gpu}) == 1
    calibration = [r for r in rows if r["calibration"]]
    assert sorted(r["name"] for r in calibration) == ["GPT 1T", "GPT-3 175B (96 H100)"]
    for r in calibration:
        assert abs(r["error"]) < 0.005
    predicted = [r for r in rows if not r["calibration"]]
    assert len(predicted) == 10
    bad = [(r["name"], r["reported_tflops"], r["predicted_tflops"]) for r in predicted
           if abs(r["error"]) > 0.15]
    assert not bad, f"outside ±15 %: {bad}"


def test_cluster_presets_carry_the_fitted_efficiencies():
    rows = {r["gpu"]: r["efficiency"] for r in published_runs.published_runs_comparison()}
    assert DGX_A100_80GB.matmul_efficiency == pytest.approx(rows["a100"], abs=0.005)
    assert DGX_H100.matmul_efficiency == pytest.approx(rows["h100"], abs=0.005)


def test_any_table1_row_as_the_calibration_keeps_the_others_within_15_percent():
    # The fit does not hinge on the choice of the 1T run.
    for run in TABLE1:
        rows = published_runs.published_runs_comparison({"a100": run["name"]})
        worst = max(abs(r["error"]) for r in rows)
        assert worst <= 0.15, (run["name"], worst)


def test_the_fit_needs_memory_bound_ops_and_unoverlapped_communication():
    # Refit without each effect: Table 1 runs differ in h (elementwise work ∝ 1/h relative to
    # the matmuls), t (TP all-reduces, not overlapped in 2021) and d·params (the DP all-reduce
    # after the flush); leaving any of these out pushes some row past ±15 %.
    worst = {r["left_out"]: r["worst_a100"] for r in published_runs.effect_ablation()}
    assert abs(worst["nothing"]) <= 0.15
    for effect in ("elementwise", "tp_comm", "dp_comm"):
        assert abs(worst[effect]) > 0.15, effect
    with pytest.raises(ValueError, match="unknown effects"):
        predict_iteration(GPT3, ParallelConfig(), DGX_A100_80GB, ignore=("magic",))


def test_strong_scaling_loses_utilisation_for_the_reasons_the_readme_gives():
    # 96 -> 4608 H100s at a fixed batch of 1152: m falls from 384 to 8 micro-batches per
    # pipeline, so the bubble and the exposed data-parallel traffic grow.
    rows = {r["name"]: r for r in published_runs.published_runs_comparison()}
    small, big = rows["GPT-3 175B (96 H100)"], rows["GPT-3 175B (4608 H100)"]
    assert (small["m"], big["m"]) == (384, 8)
    assert big["predicted_tflops"] < small["predicted_tflops"]
    assert big["shares"]["bubble"] > 5 * small["shares"]["bubble"]
    assert big["shares"]["dp_comm"] > small["shares"]["dp_comm"]


def test_published_data_is_consistent_with_itself():
    for run in RUNS["runs"]:
        assert run["source"] in RUNS["sources"], run["name"]
        model, cfg, cluster = published_runs.run_inputs(run)
        assert cfg.num_gpus == run["parallel"]["num_gpus"]
        assert not cfg.problems(model), run["name"]
        rep = run["reported"]
        if rep["metric"] == "tflops_with_recompute":
            # aggregate PFLOP/s ≈ TFLOP/s per GPU × GPUs; % of peak ≈ TFLOP/s / 312
            assert rep["tflops_per_gpu"] * cfg.num_gpus / 1e3 == \
                pytest.approx(rep["aggregate_pflops"], rel=0.015)
            assert 100 * rep["tflops_per_gpu"] / 312 == \
                pytest.approx(rep["percent_of_peak"], abs=0.6)
    one_t = next(r for r in RUNS["runs"] if r["name"] == "GPT 1T")
    assert one_t["reported"]["aggregate_pflops"] == 502.0       # the abstract
    assert one_t["parallel"]["num_gpus"] == 3072
    assert one_t["reported"]["percent_of_peak"] == 52


@pytest.mark.parametrize("run", TABLE1, ids=[r["name"] for r in TABLE1])
def test_parameter_count_reproduces_table1(run):
    model, _, _ = published_runs.run_inputs(run)
    assert round(parameter_count(model) / 1e9, 1) == run["model"]["params_billion"]


# --------------------------------------------------------------------------- formulas
def test_parameter_count_is_the_papers_closed_form():
    # Narayanan et al. 2021 §5.1: P = 12 l h² (1 + 13/(12h) + (V + s)/(12 l h))
    l, h, V, s = 96, 12288, 51200, 2048
    closed = 12 * l * h * h * (1 + Fraction(13, 12 * h) + Fraction(V + s, 12 * l * h))
    assert parameter_count(GPT3) == closed == 174_615_822_336


def test_flops_per_iteration_are_the_papers_72_and_96_forms():
    B, s, l, h, V = 3072, 2048, 128, 25600, 51200
    with_recompute = 96 * B * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(V, 16 * l * h))
    without = 72 * B * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(V, 12 * l * h))
    assert hardware_flops_per_iteration(GPT_1T, B, "full") == pytest.approx(float(with_recompute),
                                                                           rel=1e-12)
    assert model_flops_per_iteration(GPT_1T, B) == pytest.approx(float(without), rel=1e-12)
    assert hardware_flops_per_iteration(GPT_1T, B, "none") == model_flops_per_iteration(GPT_1T, B)
    # per token: 6N' + 12·L·h·s (N' = the 12·L·h² layer weights plus the V·h output layer)
    per_token = 6 * (12 * l * h * h + V * h) + 12 * l * h * s
    assert model_flops_per_iteration(GPT_1T, 1) / s == pytest.approx(per_token, rel=1e-12)
    # §5.1's end-to-end estimate for the 1T model: 450B tokens on 3072 GPUs at 163 TFLOP/s
    # take about 84 days (the paper uses 8·T·P, which these FLOPs approach)
    per_token = hardware_flops_per_iteration(GPT_1T, 1, "full") / s
    days = per_token * 450e9 / (3072 * 163e12) / 86400
    assert days == pytest.approx(84, abs=1.5)


def test_selective_recompute_adds_one_attention_core():
    # the QKᵀ and the weighted sum again: 4·s·h FLOPs per token per layer, forward only
    B = 8
    extra = hardware_flops_per_iteration(GPT3, B, "selective") - model_flops_per_iteration(GPT3, B)
    assert extra == pytest.approx(B * 2048 * 96 * 4 * 2048 * 12288, rel=1e-12)


def test_bubble_fractions():
    assert bubble_fraction(8, 32) == 7 / 32
    assert bubble_fraction(8, 32, v=4) == 7 / 128
    assert bubble_fraction(1, 5) == 0
    # the same numbers as the pipeline package's own (independent) formula
    from mpu_lab.perf.pipeline_simulation import analytic_bubble
    for p, m, v in ((4, 8, 1), (4, 8, 2), (8, 3, 1)):
        assert bubble_fraction(p, m, v) == float(analytic_bubble(p, m, v)["relative"])
    with pytest.raises(ValueError, match="m must be >= 1"):
        bubble_fraction(4, 0)


def test_tensor_parallel_traffic_per_layer():
    # Narayanan §3.3: 2 all-reduces forward + 2 backward of b·s·h; ring: 2(t-1)/t per GPU
    assert ring_all_reduce_factor(8) == 1.75
    assert ring_all_reduce_factor(1) == 0
    cfg = ParallelConfig(tp=8, micro_batch_size=1, global_batch_size=1)
    tp = tp_comm_per_layer(GPT3, cfg)
    assert tp["count"] == 4
    assert tp["message_bytes"] == 2048 * 12288 * 2 == 50_331_648
    assert tp["bytes"] == 4 * 1.75 * 50_331_648
    # full recomputation runs the forward's two all-reduces again; SP moves the same volume
    full = tp_comm_per_layer(GPT3, ParallelConfig(tp=8, recompute="full"))
    assert full["count"] == 6
    sp = tp_comm_per_layer(GPT3, ParallelConfig(tp=8, sequence_parallel=True))
    assert sp["bytes"] == tp["bytes"]
    assert tp_comm_per_layer(GPT3, ParallelConfig(tp=1))["bytes"] == 0


def test_pipeline_and_data_parallel_volumes():
    cfg = ParallelConfig(tp=8, pp=8, dp=4, micro_batch_size=1, global_batch_size=64)
    # scatter/gather (§4.1): each TP rank sends 1/t of the b·s·h activation
    assert pipeline_p2p_bytes(GPT3, cfg) == 2048 * 12288 * 2 / 8
    assert pipeline_p2p_bytes(GPT3, ParallelConfig(tp=8)) == 0
    # stage 0: 12 of 96 layers plus the word and position embeddings, all split 8 ways (the
    # position embedding is not split), 2-byte gradients, ring factor 2·3/4
    layer = 12 * 12288 ** 2 + 13 * 12288
    n = 12 * layer / 8 + 51200 * 12288 / 8 + 2048 * 12288
    assert parameters_per_gpu(GPT3, cfg) == pytest.approx(n)
    assert dp_allreduce_bytes(GPT3, cfg) == pytest.approx(1.5 * 2 * n)


def test_in_flight_microbatches_of_each_schedule():
    assert in_flight_microbatches(ParallelConfig(pp=8, global_batch_size=32)) == 8   # 1F1B: p
    assert in_flight_microbatches(ParallelConfig(pp=8, global_batch_size=4)) == 4    # m < p
    assert in_flight_microbatches(ParallelConfig(pp=8, global_batch_size=32,
                                                 schedule="gpipe")) == 32           # all m
    # Korthikanti §4.2.3: interleaved keeps p·(1 + (p-1)/(p·v)) micro-batch equivalents
    assert in_flight_microbatches(ParallelConfig(pp=4, virtual_stages=2,
                                                 global_batch_size=8)) == 4 * (1 + 3 / 8)


def test_memory_per_gpu_mixed_precision_adam_and_korthikanti_activations():
    cfg = ParallelConfig(tp=8, pp=8, dp=1, micro_batch_size=1, global_batch_size=64,
                         sequence_parallel=True)
    mem = memory_per_gpu(GPT3, cfg)
    n = parameters_per_gpu(GPT3, cfg)
    # Megatron-core's distributed-optimizer guide, fp16 params / fp16 grads: 20 bytes per
    # parameter (2 + 2 + fp32 main param 4 + fp32 main grad 4 + Adam m 4 + v 4)
    assert mem["weights"] + mem["gradients"] + mem["optimizer"] == pytest.approx(20 * n)
    # Korthikanti Table 2, TP+SP: sbh/t (34 + 5as/h) = 358,612,992 bytes per layer; stage 0
    # holds 12 layers for p = 8 micro-batches in flight
    assert mem["activations"] == pytest.approx(358_612_992 * 12 * 8)
    # selective recomputation drops the 5as/h = 80 of 114: the paper's "70 %" for GPT-3
    sel = memory_per_gpu(GPT3, ParallelConfig(**{**cfg.__dict__, "recompute": "selective"}))
    assert 1 - sel["activations"] / mem["activations"] == pytest.approx(80 / 114)
    assert round(80 / 114, 2) == 0.70
    # full recomputation: the layer input 2sbh/t per layer, plus one layer being recomputed
    full = memory_per_gpu(GPT3, ParallelConfig(**{**cfg.__dict__, "recompute": "full"}))
    assert full["activations"] == pytest.approx(2 * 2048 * 12288 / 8 * 12 * 8 + 358_612_992)
    # the distributed optimizer shards the 16 fp32 bytes over d: 4 + 16/d
    dist = memory_per_gpu(GPT3, ParallelConfig(**{**cfg.__dict__, "dp": 4,
                                                  "global_batch_size": 256,
                                                  "distributed_optimizer": True}))
    assert dist["optimizer"] == pytest.approx(16 * n / 4)
    assert dist["weights"] + dist["gradients"] == pytest.approx(4 * n)


def test_prediction_reacts_to_each_cause_the_way_the_papers_say():
    base = ParallelConfig(tp=8, pp=8, dp=2, micro_batch_size=1, global_batch_size=64,
                          recompute="full")
    a = predict_iteration(GPT3, base, DGX_A100_80GB)
    assert a.pp_p2p_s > 0 and a.tp_comm_s > 0 and a.dp_comm_s > 0
    assert a.total_s == pytest.approx(sum(a.breakdown().values()))
    # m = 32 micro-batches: the 1F1B bubble is (p-1)/m of the busy pipeline time
    busy = a.compute_s + a.tp_comm_s + a.pp_p2p_s
    assert a.bubble_s == pytest.approx(busy * 7 / 32)
    # interleaving with v = 2 halves it (Narayanan §2.2.2)
    b = predict_iteration(GPT3, ParallelConfig(**{**base.__dict__, "virtual_stages": 2}),
                          DGX_A100_80GB)
    assert b.bubble_s / a.bubble_s == pytest.approx(0.5, rel=0.05)
    # a TP group spanning two nodes pays the network instead of NVLink (300 vs 25 GB/s)
    c = predict_iteration(GPT3, ParallelConfig(tp=16, pp=4, dp=2, global_batch_size=64,
                                               recompute="full"), DGX_A100_80GB)
    per_layer_a = a.tp_comm_s / 12
    per_layer_c = c.tp_comm_s / 24
    assert per_layer_c / per_layer_a > 10
    # no recomputation: 72 instead of 96 — fewer FLOPs, faster, more memory
    d = predict_iteration(GPT3, ParallelConfig(**{**base.__dict__, "recompute": "none"}),
                          DGX_A100_80GB)
    assert d.total_s < a.total_s and d.memory_gb > a.memory_gb
    assert d.mfu > a.mfu


def test_invalid_configurations_name_their_numbers():
    with pytest.raises(ValueError, match="tp 5 does not divide num_attention_heads 96"):
        predict_iteration(GPT3, ParallelConfig(tp=5), DGX_A100_80GB)
    with pytest.raises(ValueError, match="global batch 10 is not divisible by micro-batch 2 x "
                                         "data-parallel 4 = 8"):
        ParallelConfig(dp=4, micro_batch_size=2, global_batch_size=10).check()
    with pytest.raises(ValueError, match="pp 5 x virtual_stages 1 does not divide num_layers 96"):
        ParallelConfig(pp=5, global_batch_size=5).check(GPT3)
    with pytest.raises(ValueError, match="recompute must be one of"):
        ParallelConfig(recompute="some").check()
    with pytest.raises(ValueError, match="needs m = 6 micro-batches to be a multiple of pp = 4"):
        ParallelConfig(pp=4, virtual_stages=2, global_batch_size=6).check()
    with pytest.raises(ValueError, match="hidden_size 100 is not divisible"):
        ModelShape(2, 100, 3, 16, 64)
    with pytest.raises(ValueError, match="matmul_efficiency must be in"):
        DGX_A100_80GB.replace(matmul_efficiency=1.5)


def test_cluster_presets_are_the_datasheet_figures():
    assert DGX_A100_80GB.peak_flops == 312e12 and DGX_H100.peak_flops == 989e12
    assert DGX_A100_80GB.gpus_per_node == DGX_H100.gpus_per_node == 8
    # 200 Gb/s and 400 Gb/s per GPU port
    assert DGX_A100_80GB.inter_node_bandwidth == 200e9 / 8
    assert DGX_H100.inter_node_bandwidth == 400e9 / 8


# --------------------------------------------------------------------------- explorer
SMALL = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                   vocab_size=128, name="small")


def test_enumeration_finds_exactly_the_valid_splits():
    # 4 GPUs, batch 8, b in {1, 2}: t in {1, 2, 4} (divides 4 heads); t=1: p in {1, 2, 4},
    # t=2: p in {1, 2}, t=4: p=1 — 6 (t, p) pairs; B=8 is a multiple of b·d for every one of
    # them and both b, so 12 configurations.
    cfgs = explorer.enumerate_configs(SMALL, 4, 8, micro_batch_sizes=(1, 2))
    got = sorted((c.tp, c.pp, c.dp, c.b) for c in cfgs)
    want = sorted((t, p, 4 // (t * p), b) for t, p in
                  ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)) for b in (1, 2))
    assert got == want
    assert all(c.sequence_parallel == (c.tp > 1) for c in cfgs)
    # B = 6: d = 4 needs b·4 | 6 — never; so the t=1, p=1 split drops out
    six = explorer.enumerate_configs(SMALL, 4, 6, micro_batch_sizes=(1, 2))
    assert (1, 1) not in {(c.tp, c.pp) for c in six}


def test_explorer_rejects_bad_inputs_with_the_values():
    with pytest.raises(ValueError, match="num_gpus must be a positive integer, got 0"):
        explorer.explore(SMALL, DGX_A100_80GB, 0, 8)
    with pytest.raises(ValueError, match="global_batch_size must be a positive integer"):
        explorer.explore(SMALL, DGX_A100_80GB, 4, -1)
    with pytest.raises(ValueError, match="micro_batch_sizes is empty"):
        explorer.explore(SMALL, DGX_A100_80GB, 4, 8, micro_batch_sizes=())
    with pytest.raises(ValueError, match="no valid .* 3 GPUs and global batch 5"):
        explorer.explore(SMALL, DGX_A100_80GB, 3, 5, micro_batch_sizes=(2,))
    with pytest.raises(ValueError, match="num_gpus 256 is more than the cluster's 128"):
        explorer.explore(SMALL, DGX_A100_80GB.replace(num_nodes=16), 256, 512)


def test_explorer_flags_the_classic_mistakes():
    gpt39 = ModelShape(num_layers=48, hidden_size=8192, num_attention_heads=64,
                       seq_length=2048, vocab_size=51200, name="GPT 39B")
    res = explorer.explore(gpt39, DGX_A100_80GB.replace(num_nodes=16), 128, 512)
    # the best split keeps TP inside a node and fits
    assert res.best.fits and res.best.config.tp <= 8 and not res.best.reasons
    # ranking: every fitting configuration before any that does not, fastest first
    fits = [c.fits for c in res.candidates]
    assert fits == sorted(fits, reverse=True)
    times = [c.prediction.total_s for c in res.fitting()]
    assert times == sorted(times)
    # TP across nodes
    wide = res.find(t=32, p=1, b=1)
    assert any("crosses nodes" in r for r in wide.reasons) and "TP>node" in wide.short_flags()
    # a 16-stage pipeline with 8 micro-batches: bubble and idle stages; and no fit at t=1
    deep = res.find(t=1, p=16, b=8)
    assert deep.config.m == 8
    assert any("pipeline bubble" in r and "(16-1)/(1·8)" in r for r in deep.reasons)
    assert any("only m=8 micro-batches for p=16" in r for r in deep.reasons)
    assert any(r.startswith("does not fit") for r in deep.reasons) and not deep.fits
    with pytest.raises(ValueError, match=r"\(t=3, p=1"):
        res.find(t=3, p=1)


def test_explorer_table_and_records_are_deterministic():
    a = explorer.explore(SMALL, DGX_A100_80GB, 4, 8, micro_batch_sizes=(1, 2))
    b = explorer.explore(SMALL, DGX_A100_80GB, 4, 8, micro_batch_sizes=(1, 2))
    assert a.table(top=None) == b.table(top=None)
    assert a.table(top=3).count("\n") == 3 + 3      # a 2-line title, head, rule
    recs = a.records()
    assert [r["rank"] for r in recs] == list(range(1, 13))
    assert {"t", "p", "d", "b", "m", "time_s", "mfu", "memory_gb", "fits", "flags",
            "bubble_share"} <= set(recs[0])
    assert "t=" in a.explain(a.best)


# --------------------------------------------------------------------------- calibration
def test_cpu_cluster_from_given_measurements_and_train_config_shapes():
    cal = dict(matmul_flops=5e10, memory_bandwidth=2e10, latency_s=1e-3, busbw=1e9)
    cl = calibrate.cpu_cluster(2, cal)
    assert (cl.peak_flops, cl.matmul_efficiency, cl.latency_s) == (5e10, 1.0, 1e-3)
    tc = calibrate.TrainConfig(tp=2, vocab_size=500)
    model, cfg = tc.shapes()
    assert model.vocab_size == 512            # padded to a multiple of 128 x t, as Megatron
    assert cfg.num_gpus == tc.nproc == 2
    assert "--tensor-model-parallel-size" in tc.argv("m.jsonl")
    # the TP-split GEMMs of one layer: QKV is b·s × h → 3h/t
    assert calibrate.layer_matmul_shapes(model, cfg)[0] == (1, 8 * 128, 256, 384)


@pytest.mark.slow
def test_calibration_job_measures_positive_rates_on_every_rank():
    cal = calibrate.calibrate_ranks(2, [[(1, 64, 64, 64)], [(2, 32, 32, 32)]])
    assert len(cal["matmul_flops_sets"]) == 2
    assert cal["matmul_flops"] > 1e8 and cal["memory_bandwidth"] > 1e8
    assert 0 < cal["latency_s"] < 1 and cal["busbw"] > 1e6
