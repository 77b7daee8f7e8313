"""mpu_lab.perf.kernel_timeline: compute / communication / idle per rank from profiler traces.

Two hand-made traces with the answers worked by hand (a CPU/gloo one, and a CUDA one written
from the Kineto Chrome-trace format: ``cat`` "kernel" / "gpu_memcpy", ``pid`` the device,
``tid`` the stream), then one real 2-rank ``train_gpt.py --pipeline-model-parallel-size 2
--breakdown-profile`` job: with one micro-batch each stage waits for the other.
"""
import json

import pytest

from mpu_lab import launcher
from mpu_lab.labkit.performance import viz
from mpu_lab.perf import kernel_timeline as kt, op_classes


def _x(name, ts, dur, cat="cpu_op", pid=100, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": {}}


def cpu_trace(rank=0, base_ns=0):
    """Main thread (tid 1) and a gloo thread (tid 2) of one rank, µs:

    [0,20] aten::mm                                  compute
    [10,25] gloo:all_reduce on the gloo thread       comm where nothing computes: [20,25]
    [30,70] a backward function, inside it
       [40,50] c10d::allreduce_                      comm (innermost), the rest compute
    [80,95] gloo:recv (the work, issue to completion), inside it
       [85,90] aten::add started later               compute; [80,85] and [90,95] comm
    [96,98] aten::broadcast_tensors                  compute (an aten op, not a collective)
    ProfilerStep#1 and the profiler's own span enclose everything and are left out.
    """
    events = [
        _x("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _x("PyTorch Profiler (0)", 0, 100, cat="Trace", pid="Spans", tid="PyTorch Profiler"),
        _x("aten::mm", 0, 20),
        _x("gloo:all_reduce", 10, 15, cat="user_annotation", tid=2),
        _x("autograd::engine::evaluate_function: _ReduceFromModelParallelRegionBackward", 30, 40),
        _x("c10d::allreduce_", 40, 10),
        _x("gloo:recv", 80, 15, cat="user_annotation"),
        _x("aten::add", 85, 5),
        _x("aten::broadcast_tensors", 96, 2),
        {"ph": "s", "cat": "fwdbwd", "name": "fwdbwd", "pid": 100, "tid": 1, "ts": 1, "id": 1},
        {"ph": "M", "name": "thread_name", "pid": 100, "tid": 2, "args": {"name": "gloo"}},
    ]
    return {"traceEvents": events, "baseTimeNanoseconds": base_ns,
            "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2}}


def cuda_trace(rank=0):
    """One GPU (pid 0), compute stream 7 and communication stream 20, µs:

    [0,5]   Memcpy HtoD (gpu_memcpy)                 compute (the device is busy)
    [10,40] a bf16 GEMM on stream 7                  compute
    [30,50] NCCL all-reduce on stream 20             comm only where no GEMM runs: [40,50]
    [50,90] NCCL send/recv on stream 7, spinning until the peer sends: comm
    The CPU side (aten::mm, cudaLaunchKernel) and the gpu_user_annotation are not the device's
    work and are left out. Window (0, 100): compute 35, comm 50, idle 15.
    """
    events = [
        _x("aten::mm", 0, 100),
        _x("cudaLaunchKernel", 2, 3, cat="cuda_runtime"),
        _x("forward", 0, 100, cat="gpu_user_annotation", pid=0, tid=7),
        _x("Memcpy HtoD (Pageable -> Device)", 0, 5, cat="gpu_memcpy", pid=0, tid=7),
        _x("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 10, 30, cat="kernel",
           pid=0, tid=7),
        _x("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 30, 20,
           cat="kernel", pid=0, tid=20),
        _x("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 50, 40, cat="kernel",
           pid=0, tid=7),
    ]
    return {"traceEvents": events, "deviceProperties": [{"id": 0, "name": "NVIDIA H100"}],
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2}}


def test_cpu_trace_classified_by_hand():
    device, compute, comm, count = kt.classify_trace(cpu_trace())
    assert device == "cpu" and count == 3
    assert compute == [(0, 20), (30, 40), (50, 70), (85, 90), (96, 98)]
    assert comm == [(20, 25), (40, 50), (80, 85), (90, 95)]
    tl = kt.kernel_timeline(cpu_trace(), window=(0, 100), bin_ms=0.05)      # 50 µs bins
    assert (tl.compute, tl.comm, tl.idle) == ([30, 27], [15, 10], [5, 13])
    s = tl.summary()
    assert (s["busy_pct"], s["comm_pct"], s["idle_pct"]) == pytest.approx((57, 25, 18))
    assert s["window_s"] == pytest.approx(1e-4)


def test_cuda_trace_classified_by_hand():
    tr = cuda_trace()
    assert kt.trace_device(tr) == "cuda"
    device, compute, comm, count = kt.classify_trace(tr)
    assert device == "cuda" and count == 2
    assert compute == [(0, 5), (10, 40)] and comm == [(40, 90)]
    s = kt.kernel_timeline(tr, window=(0, 100), bin_ms=1).summary()
    assert (s["busy_pct"], s["comm_pct"], s["idle_pct"]) == pytest.approx((35, 50, 15))
    # default window: first to last device event, (0, 90): idle is the 5 µs gap only
    assert kt.kernel_timeline(tr).summary()["idle_s"] == pytest.approx(5e-6)


def test_names_of_communication():
    for name in ("c10d::send", "c10d::recv_", "c10d::allreduce_", "gloo:broadcast",
                 "record_param_comms", "nccl:all_reduce"):
        assert kt.is_communication(name), name
    for name in ("aten::mm", "aten::broadcast_tensors", "Optimizer.step#AdamW.step"):
        assert not kt.is_communication(name), name
    assert kt.is_communication("ncclKernel_AllGather_RING_LL_Sum_int8_t", "cuda")
    assert not kt.is_communication("ampere_sgemm_128x64_tn", "cuda")


def test_ranks_in_order_on_one_window_from_the_step_windows(tmp_path):
    paths = []
    for rank in (1, 0):
        path = tmp_path / f"rank{rank}.trace.json"
        path.write_text(json.dumps(cpu_trace(rank, base_ns=10 ** 12)))   # ts 0 = 1000 s
        paths.append(str(path))
    # train_gpt.py results: the timed steps (wall-clock seconds) over µs 0..100 of the traces
    results = [{"breakdown": {"window": [1000.0, 1000.0001], "profile": {"trace": p}}}
               for p in reversed(paths)]
    tls = kt.kernel_timelines(results, bin_ms=0.05)
    assert [t.rank for t in tls] == [0, 1]
    assert tls[0].window == pytest.approx((0, 100)) and tls[0].compute == pytest.approx([30, 27])
    assert kt.kernel_timelines([r["breakdown"] for r in results], 0.05)[1].window == tls[1].window
    by_dir = kt.kernel_timelines(str(tmp_path))      # no step window: first to last event
    assert [t.window for t in by_dir] == [(0, 98), (0, 98)]
    table = kt.format_kernel_summary(tls).splitlines()
    assert len(table) == 3 and table[1].split()[:6] == ["0", "cpu", "0.1", "57.0", "25.0", "18.0"]
    fig = viz.plot_kernel_timeline({"a": tls, "b": by_dir}, title="two runs")
    assert len(fig.axes) == 2 and fig.axes[0].get_yticklabels()[0].get_text().startswith("rank 0")
    with pytest.raises(ValueError, match="--breakdown-profile"):
        kt.kernel_timelines([{"breakdown": {"window": [0, 1]}}])
    with pytest.raises(ValueError, match="bin_ms"):
        kt.kernel_timeline(cpu_trace(), bin_ms=0)


# --------------------------------------------------------------------------- one real job
@pytest.fixture(scope="module")
def pp2_results(tmp_path_factory):
    prof = tmp_path_factory.mktemp("pp2_profile")
    flags = ["--pipeline-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "128",
             "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "3",
             "--log-interval", "1", "--quiet", "--breakdown-profile", str(prof)]
    return launcher.run("train_gpt.py", flags, nproc=2, show="none", timeout_s=180).results


@pytest.fixture(scope="module")
def pp2_timelines(pp2_results):
    return kt.kernel_timelines(pp2_results, bin_ms=5.0)


def _own_us(op, ops):
    """``op``'s duration less that of the ops directly inside it on its thread (those not
    inside another op inside it), from the trace's spans alone."""
    start, end = op["ts"], op["ts"] + op["dur"]
    inside = sorted((o for o in ops if o is not op and o["tid"] == op["tid"] and
                     start <= o["ts"] and o["ts"] + o["dur"] <= end),
                    key=lambda o: (o["ts"], -o["dur"]))
    direct, covered_to = 0.0, float("-inf")
    for o in inside:
        if o["ts"] >= covered_to:
            direct += o["dur"]
            covered_to = o["ts"] + o["dur"]
    return op["dur"] - direct


def test_op_classes_of_a_real_job_agree_with_the_profilers_own_tables(pp2_results):
    """mpu_lab.perf.op_classes on the same traces, checked against a second method: the
    profiler's own per-op self times (``key_averages``, the report's ``top_ops``). The matmul
    class holds exactly the GEMMs' and SDPA's self time (each its own innermost span), the
    classes fill the profiled window, and every class the step has shows up."""
    profiles = op_classes.op_class_profiles(pp2_results)
    assert [p.rank for p in profiles] == [0, 1]
    for p, result in zip(profiles, pp2_results):
        b = result["breakdown"]
        assert p.steps == b["steps"] and p.ops > 50
        assert sum(p.seconds.values()) == pytest.approx(p.step_s)
        for c in ("matmul", "non-matmul", "communication", "optimizer", "framework"):
            assert p.seconds[c] > 0, c
        top = {o["name"]: o["self_ms"] / 1e3 for o in b["profile"]["top_ops"]}
        gemm_self = sum(v for k, v in top.items() if op_classes.op_class(k) == "matmul")
        # top_ops lists the 12 costliest ops by self time: the matmul class holds at least the
        # GEMMs listed there, and at most that plus, for each of the 7 matmul kinds
        # (MATMUL_OPS and SDPA's two fused kernels), the self time of the 12th op
        missing = len(op_classes.MATMUL_OPS) + 2
        assert gemm_self * 0.98 <= p.seconds["matmul"] <= gemm_self + missing * min(top.values())
        # a third count, from the raw events: each GEMM of MATMUL_OPS less the ops directly
        # inside it (aten::addmm copies its bias into the output first, an aten::copy_ that a
        # loaded machine once stretched to 7.7 ms of a 7.9 ms addmm); SDPA's kernels may open
        # allocations inside; so the class lies between the GEMMs' own time and that plus
        # SDPA's durations
        events = kt.load_trace(b["profile"]["trace"])["traceEvents"]
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        own = {kind: sum(_own_us(e, ops) if kind else e["dur"] for e in ops
                         if op_classes.op_class(e["name"]) == "matmul" and
                         (e["name"] in op_classes.MATMUL_OPS) == kind) / 1e6 / p.steps
               for kind in (True, False)}
        assert own[True] * 0.98 <= p.seconds["matmul"] <= (own[True] + own[False]) * 1.02
        # the step's window contains the timed steps the StepTimer measured without overhead
        assert p.step_s == pytest.approx(b["step_s"], rel=0.35)


def test_pp2_with_one_micro_batch_leaves_each_stage_idle_and_communicating(pp2_timelines):
    print("\n" + kt.format_kernel_summary(pp2_timelines))
    assert [t.rank for t in pp2_timelines] == [0, 1]
    for tl in pp2_timelines:
        s = tl.summary()
        assert tl.device == "cpu"
        assert s["busy_pct"] + s["comm_pct"] + s["idle_pct"] == pytest.approx(100)
        assert tl.comm_events >= 4            # a send and a receive per step, the all-reduces
        assert s["comm_pct"] > 0 and s["idle_pct"] > 0 and s["busy_pct"] > 0
        # one micro-batch: a stage never computes for the whole window; the other stage's
        # turn is spent waiting (communication) or doing nothing
        assert s["busy_pct"] < 75
        assert all(abs(c + m + i - tl.bin_us) < 1e-6
                   for c, m, i in zip(tl.compute[:-1], tl.comm[:-1], tl.idle[:-1]))
