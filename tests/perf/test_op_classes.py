"""mpu_lab.perf.op_classes (a profiled step by op class against the cost model's terms) and the
cost model's host-overhead term: hand-made traces and values worked by hand.

The real 2-rank profiled job is checked in tests/perf/test_kernel_timeline.py (it shares that job).
"""
import types

import pytest

from mpu_lab.perf import calibrate, op_classes as oc
from mpu_lab.perf.cost_model import DGX_A100_80GB, ModelShape, ParallelConfig, predict_iteration


def _x(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}


def cpu_trace():
    """Two steps of one rank's main thread (tid 1), µs, worked by hand:

    [0,40]    aten::linear, inside it [5,35] aten::addmm     matmul 30, non-matmul 10 (self)
    [40,50]   nothing open                                   framework 10
    [50,90]   _ReduceFromModelParallelRegion, inside it [52,56] aten::clone (non-matmul 4) and
              [56,60] c10d::allreduce_ (communication 4); the span's own 32 µs are the
              blocking collective's wait                    communication 36
    [90,120]  the autograd engine's GeluBackward0, inside it [95,115] aten::gelu_backward
                                                             non-matmul 20, framework 10
    [120,140] SDPA's fused attention                         matmul 20
    [140,200] nothing open                                   framework 60
    [200,230] Optimizer.step#AdamW.step, inside it [205,215] aten::add_   optimizer 30
    A gloo thread (tid 2) with fewer CPU ops is not the main thread and is left out.
    Totals: matmul 50, non-matmul 34, communication 36, optimizer 30, framework 80 = 230;
    spans on the main thread (the optimizer's annotation aside): 9.
    """
    events = [
        _x("aten::linear", 0, 40), _x("aten::addmm", 5, 30),
        _x("_ReduceFromModelParallelRegion", 50, 40), _x("aten::clone", 52, 4),
        _x("c10d::allreduce_", 56, 4),
        _x("autograd::engine::evaluate_function: GeluBackward0", 90, 30),
        _x("aten::gelu_backward", 95, 20),
        _x("aten::_scaled_dot_product_flash_attention_for_cpu", 120, 20),
        _x("Optimizer.step#AdamW.step", 200, 30, cat="user_annotation"),
        _x("aten::add_", 205, 10),
        _x("gloo:all_reduce", 56, 30, cat="user_annotation", tid=2),
        _x("aten::copy_", 60, 1, tid=2),
    ]
    return {"traceEvents": events, "distributedInfo": {"rank": 1}}


def test_cpu_trace_booked_by_class_by_hand():
    p = oc.op_class_profile(cpu_trace(), steps=2)
    assert p.rank == 1 and p.device == "cpu" and p.steps == 2
    want = {"matmul": 50, "non-matmul": 34, "communication": 36, "optimizer": 30,
            "framework": 80}
    assert p.seconds == pytest.approx({k: v / 2 / 1e6 for k, v in want.items()})
    assert p.step_s == pytest.approx(115e-6) and p.ops == pytest.approx(4.5)
    assert sum(p.shares().values()) == pytest.approx(1.0)


def test_gpu_trace_by_kernel_name():
    """Kernels: a GEMM [0,10], an NCCL all-reduce [10,30], a layer norm [30,35]; nothing ran
    [35,40] (framework: the device waited for the host)."""
    events = [_x("sm90_xmma_gemm_bf16", 0, 10, cat="kernel", tid=7),
              _x("ncclDevKernel_AllReduce", 10, 20, cat="kernel", tid=20),
              _x("vectorized_layer_norm_kernel", 30, 5, cat="kernel", tid=7),
              _x("triton_red_fused", 38, 2, cat="kernel", tid=7)]
    p = oc.op_class_profile({"traceEvents": events}, steps=1)
    assert p.device == "cuda"
    assert p.seconds == pytest.approx({"matmul": 10e-6, "communication": 20e-6,
                                       "non-matmul": 7e-6, "optimizer": 0.0,
                                       "framework": 3e-6})


def test_names_and_bad_input():
    assert oc.op_class("aten::bmm") == "matmul"
    assert oc.op_class("aten::gelu") == "non-matmul"
    assert oc.op_class("c10d::broadcast_") == "communication"
    assert oc.op_class("LinearWithGradAccumulationAndAsyncCommunicationBackward") == "framework"
    assert oc.op_class("LinearWithGradAccumulationAndAsyncCommunicationBackward",
                       has_comm_child=True) == "communication"
    with pytest.raises(ValueError, match="steps must be >= 1"):
        oc.op_class_profile(cpu_trace(), steps=0)
    with pytest.raises(ValueError, match="--breakdown-profile"):
        oc.op_class_profiles([{"breakdown": {"steps": 1}}])


def test_terms_set_against_a_prediction_by_hand():
    """A prediction of 100 ms: matmul 50, elementwise 10, TP 10 + p2p 5 + bubble 5 + DP 0,
    optimizer 10, framework 20. The slower of two ranks (230 µs of profile per 2 steps) is
    compared; a measured unprofiled step of 0.23 s scales each share to seconds."""
    pred = types.SimpleNamespace(matmul_s=0.05, elementwise_s=0.01, tp_comm_s=0.01,
                                 pp_p2p_s=0.005, bubble_s=0.005, dp_comm_s=0.0,
                                 optimizer_s=0.01, framework_s=0.02, total_s=0.1)
    fast = oc.OpClassProfile(0, "cpu", 2, 1e-6, dict.fromkeys(oc.OP_CLASSES, 0.2e-6), 1)
    slow = oc.op_class_profile(cpu_trace(), steps=2)
    rows = {r["term"]: r for r in oc.compare_terms([fast, slow], pred, measured_step_s=0.23)}
    assert rows["communication"]["predicted_s"] == pytest.approx(0.02)
    assert rows["framework"]["predicted_s"] == pytest.approx(0.02)
    assert rows["matmul"]["measured_s"] == pytest.approx(25e-6)
    assert rows["matmul"]["scaled_s"] == pytest.approx(0.05)          # 50/230 of 0.23 s
    assert rows["framework"]["scaled_s"] == pytest.approx(0.08)
    assert rows["total"]["scaled_s"] == 0.23 and rows["total"]["predicted_s"] == 0.1
    table = oc.format_terms(list(rows.values()))
    assert "framework" in table and "4.00" in table          # 80 ms measured / 20 predicted


def test_host_overhead_adds_to_the_prediction_and_shows_as_framework():
    model = ModelShape(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128,
                       vocab_size=1024)
    cfg = ParallelConfig(tp=2, micro_batch_size=2, global_batch_size=8)
    base = predict_iteration(model, cfg, DGX_A100_80GB)
    more = predict_iteration(model, cfg, DGX_A100_80GB, host_overhead_s=0.25)
    assert more.total_s == pytest.approx(base.total_s + 0.25)
    assert more.breakdown()["framework"] == 0.25 and "framework" not in base.breakdown()
    assert sum(more.breakdown().values()) == pytest.approx(more.total_s)
    with pytest.raises(ValueError, match="host_overhead_s must be >= 0"):
        predict_iteration(model, cfg, DGX_A100_80GB, host_overhead_s=-1.0)


def test_host_overhead_is_the_tiny_runs_excess_over_its_prediction(monkeypatch):
    """The tiny run keeps every flag but the width (hidden 2 per head, vocabulary 16); its
    measured 30 ms minus the model's prediction for it is the overhead."""
    seen = []

    def fake_least_contended(tc, attempts):
        seen.append(tc)
        return dict(best=0.030, median=0.031, cpu_pressure=0.0)
    monkeypatch.setattr(calibrate, "_least_contended", fake_least_contended)
    tc = calibrate.TrainConfig(tp=2, num_layers=3, hidden_size=512, num_attention_heads=8,
                               micro_batch_size=4, global_batch_size=8)
    cluster = DGX_A100_80GB
    got = calibrate.host_overhead(tc, cluster)
    (tiny,) = seen
    assert (tiny.hidden_size, tiny.vocab_size) == (16, 16)
    assert (tiny.tp, tiny.num_layers, tiny.micro_batch_size, tiny.global_batch_size,
            tiny.num_attention_heads, tiny.seq_length) == (2, 3, 4, 8, 8, tc.seq_length)
    model, cfg = tiny.shapes()
    expect = predict_iteration(model, cfg, cluster, dtype_bytes=4, grad_bytes=4).total_s
    assert expect < 1e-3                     # the tiny model's arithmetic and bytes vanish
    assert got["host_overhead_s"] == pytest.approx(0.030 - expect)
    monkeypatch.setattr(calibrate, "_least_contended",
                        lambda tc, attempts: dict(best=1e-9, median=1e-9, cpu_pressure=0.0))
    assert calibrate.host_overhead(tc, cluster)["host_overhead_s"] == 0.0   # never negative


def _bench():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "launch" / "bench_cost_model.py"
    spec = importlib.util.spec_from_file_location("bench_cost_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmarks_markdown_goes_between_the_readmes_markers(tmp_path):
    bench = _bench()
    rows = [dict(config="t=2 p=1 d=1 h=512 L=2", measured_s=0.36, predicted_s=0.3456,
                 host_overhead_s=0.0123, ratio=1.04, cpu_pressure=0.05)]
    table = bench.markdown_table(rows, ["--configs", "tp2"], 0.04, 93.2)
    assert table.startswith("`python launch/bench_cost_model.py --configs tp2`, 20")
    assert "| t=2 p=1 d=1 h=512 L=2 | 0.360 | 0.346 | 0.012 | 1.04 | 5% |" in table
    assert "Worst |measured/predicted − 1|: 4% (target ≤ 20 %)." in table
    begin, end = bench.MARKERS
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{begin}\nold table\n{end}\nafter\n")
    bench.write_markdown(str(readme), table)
    assert readme.read_text() == f"intro\n{begin}\n{table}{end}\nafter\n"
    other = tmp_path / "table.md"
    bench.write_markdown(str(other), table)
    assert other.read_text() == table


def test_the_benchmarks_page_holds_the_benchmarks_own_table():
    """docs/BENCHMARKS.md's cost-model table is what `--markdown docs/BENCHMARKS.md` wrote: between the
    markers, headed by the command and the date, one row per configuration."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "BENCHMARKS.md").read_text()
    begin, end = _bench().MARKERS
    block = text.split(begin, 1)[1].split(end, 1)[0]
    assert re.match(r"\n`python launch/bench_cost_model\.py[^`]*`, 20\d\d-\d\d-\d\d, ", block)
    assert block.count("\n| t=") == 3 and "Worst |measured/predicted − 1|" in block


def test_each_run_made_twice_keeps_the_faster_and_the_host_overhead_enters_the_prediction(
        monkeypatch):
    """measure_vs_predict(tries=2) on a CPU, with the jobs replaced by fixed figures: the run
    measured 0.50 s then 0.40 s counts as 0.40 s; its tiny twin 0.05 s then 0.03 s gives the
    host overhead 0.03 s minus the tiny run's prediction, and the prediction is the plain
    one plus that overhead (worked with predict_iteration itself on the same cluster)."""
    times = {16: iter([0.05, 0.03]), 512: iter([0.50, 0.40])}

    def fake_least_contended(tc, attempts):
        return dict(best=next(times[tc.hidden_size]), median=0.6, cpu_pressure=0.0)
    cal = dict(nproc=2, matmul_flops=5e10, matmul_flops_sets=[5e10], memory_bandwidth=1e10,
               latency_s=1e-3, busbw=1e9)
    monkeypatch.setattr(calibrate, "cuda_available", lambda: False)
    monkeypatch.setattr(calibrate, "calibrate_ranks", lambda n, sets: dict(cal))
    monkeypatch.setattr(calibrate, "_least_contended", fake_least_contended)
    tc = calibrate.TrainConfig(tp=2, hidden_size=512, num_attention_heads=8)
    (row,) = calibrate.measure_vs_predict([tc], tries=2)
    assert row["measured_s"] == 0.4
    cluster = calibrate.cpu_cluster(2, dict(cal))
    model, cfg = tc.tiny().shapes()
    tiny = predict_iteration(model, cfg, cluster, dtype_bytes=4, grad_bytes=4).total_s
    assert row["host_overhead_s"] == pytest.approx(round(0.03 - tiny, 4))
    model, cfg = tc.shapes()
    plain = predict_iteration(model, cfg, cluster, dtype_bytes=4, grad_bytes=4).total_s
    assert row["predicted_s"] == pytest.approx(round(plain + 0.03 - tiny, 4), abs=1e-4)
    assert row["breakdown"]["framework"] == pytest.approx(round(0.03 - tiny, 4))
    with pytest.raises(ValueError, match="tries must be >= 1"):
        calibrate.measure_vs_predict([tc], tries=0)
