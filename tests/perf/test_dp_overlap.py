"""Megatron's DDP from a real run (mpu_lab.perf.dp_overlap, launch/dp_overlap.py), against
references worked by hand: the gradient buffer's buckets from the GPT's parameter sizes, the
data-parallel bytes of a ring over d ranks, which bucket reductions start during backward, and
the rows the timeline draws. One 4-rank torchrun job for the whole file."""
import pytest

from mpu_lab.labkit.data_parallel.viz import plot_dp_timeline
from mpu_lab.labkit.data_parallel import lessons as dp_lessons
from mpu_lab.perf import dp_overlap, rank_clock
from mpu_lab.perf.cost_model import dp_overlap as overlap_model

D = 4
BUCKET_SIZE = 5000
# L = 2 layers, h = 32, V = 128, S = 16. Per layer: LayerNorms 4 x 32, QKV 3h*h + 3h = 3168,
# proj h*h + h = 1056, fc1 4h*h + 4h = 4224, fc2 4h*h + h = 4128: 12704; final LayerNorm 64;
# embeddings V*h + S*h = 4096 + 512. Total 2 x 12704 + 64 + 4608 = 30080 fp32 elements.
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
             micro_batch_size=2, vocab_size=128)
GRAD_ELEMENTS = 30080
# Reverse order (the last layer's gradients first), a new bucket once one holds >= 5000:
#  0: final LN b, w (64), layer 1 fc2 b, w (4128), fc1 b, w (4224)               = 8416, 6 params
#  1: layer 1 pre-MLP LN (64), proj (1056), QKV (3168), input LN (64), layer 0 fc2 = 8480, 10
#  2: layer 0 fc1 (4224), pre-MLP LN (64), proj (1056)                           = 5344, 6
#  3: layer 0 QKV (3168), input LN (64), position (512), word embedding (4096)   = 7840, 6
BUCKETS = [(8416, 6), (8480, 10), (5344, 6), (7840, 6)]
PLAIN, OVERLAP = "all-reduce", "distributed optimizer + overlap"


@pytest.fixture(scope="module")
def result():
    return dp_overlap.run_dp_overlap(nproc=D, steps=2, warmup=0, bucket_size=BUCKET_SIZE,
                                     modes=(PLAIN, OVERLAP), timeout_s=120, pin=True, **MODEL)


def test_pinned_ranks_report_their_own_core(result):
    cores = rank_clock.usable_cores()
    assert [r["core"] for r in result.reports] == [cores[k % len(cores)] for k in range(D)]


def test_buckets_are_the_layout_worked_by_hand(result):
    for mode in result.modes:
        for rec in result.mode(mode):
            assert [(b["numel"], b["params"]) for b in rec["buckets"]] == BUCKETS
            assert [b["padded"] % D for b in rec["buckets"]] == [0] * len(BUCKETS)
            assert rec["grad_numel"] == GRAD_ELEMENTS
            assert rec["buckets"][0]["names"][0] == "decoder.final_layernorm.bias"
            assert rec["buckets"][-1]["names"][-1] == "embedding.word_embeddings.weight"
            assert all(len(s["syncs"]) == len(BUCKETS) for s in rec["steps"])


def test_ring_formula_by_hand():
    # G = 30080 x 4 B = 120320 B over d = 4: all-reduce 2 x 3/4 x G = 180480 B sent per rank;
    # reduce-scatter 3/4 x G = 90240; all-gather: input is one shard, G/4 = 30080, sent 3 x it.
    assert dp_overlap.ring_bytes_sent("all_reduce", 120320, 4) == 180480
    assert dp_overlap.ring_bytes_sent("reduce_scatter", 120320, 4) == 90240
    assert dp_overlap.ring_bytes_sent("all_gather", 30080, 4) == 90240
    assert dp_overlap.ring_bytes_sent("all_reduce", 1000, 1) == 0
    with pytest.raises(ValueError, match="broadcast"):
        dp_overlap.ring_bytes_sent("broadcast", 1, 4)


def test_counted_volume_matches_the_gradient_bytes(result):
    g = 4 * GRAD_ELEMENTS
    rows = {(r["mode"], r["kind"]): r for r in dp_overlap.volume_rows(result)}
    assert set(rows) == {(PLAIN, "all_reduce"), (OVERLAP, "reduce_scatter"),
                         (OVERLAP, "all_gather")}
    for key, counted, tag in (((PLAIN, "all_reduce"), g, "grads.data_parallel"),
                              ((OVERLAP, "reduce_scatter"), g, "grads.data_parallel"),
                              ((OVERLAP, "all_gather"), g // D, "params.data_parallel")):
        assert rows[key]["tag"] == tag
        assert rows[key]["calls"] == len(BUCKETS)          # one collective per bucket and step
        assert rows[key]["counted_bytes"] == counted
    for mode in result.modes:                               # every rank counted the same
        assert len({str(rec["volume"]) for rec in result.mode(mode)}) == 1
    sent = {m: sum(r["sent_bytes"] for r in rows.values() if r["mode"] == m) for m in result.modes}
    assert sent == {PLAIN: 180480, OVERLAP: 180480}
    table = dp_overlap.format_volume_table(result)
    assert "30080 fp32 elements = 0.120 MB; d = 4; 2(d-1)/d x buffer = 0.180 MB" in table
    assert table.count("total sent per rank") == 2


def test_overlap_starts_buckets_during_backward_and_plain_does_not(result):
    for rec in result.mode(OVERLAP):
        for step in rec["steps"]:
            for s in step["syncs"]:
                assert s["started_in_backward"] and s["start_ms"] < step["backward_ms"], s
                assert s["start_ms"] <= s["done_ms"] <= s["end_ms"]
            # the first bucket (the last layer's) is issued first
            assert [s["bucket"] for s in step["syncs"]] == list(range(len(BUCKETS)))
    for rec in result.mode(PLAIN):
        for step in rec["steps"]:
            for s in step["syncs"]:
                assert not s["started_in_backward"] and s["start_ms"] >= step["backward_ms"], s
            assert step["exposed_ms"] > 0
    table = dp_overlap.format_overlap_table(result)
    assert table.count("0 of 4") == D and table.count("4 of 4") == D


def test_timeline_has_a_backward_and_a_row_per_bucket_per_rank(result):
    fig = plot_dp_timeline(result)
    axes = fig.axes
    assert [ax.get_title(loc="left").split(":")[0] for ax in axes] == [PLAIN, OVERLAP]
    for ax in axes:
        labels = [t.get_text() for t in ax.get_yticklabels()]
        expected = []
        for rank in range(D):
            expected += [f"rank {rank} backward"] + [f"bucket {b}" for b in range(len(BUCKETS))]
        assert labels == expected
        assert len(ax.patches) == D * (1 + len(BUCKETS))    # one bar per row


def test_bad_flags_are_refused_before_launch():
    with pytest.raises(ValueError, match="--steps 0 must be >= 1.*unknown mode 'x'"):
        dp_overlap.check_args(["--steps", 0, "--modes", "x"], 4)
    with pytest.raises(ValueError, match="at least 2"):
        dp_overlap.check_args([], 1)
    with pytest.raises(ValueError, match="--hidden-size 30 is not divisible"):
        dp_overlap.run_dp_overlap(nproc=2, hidden_size=30)


def _record(steps_ms, exposed):
    return dict(steps=[dict(step_ms=s, exposed_ms=e) for s, e in zip(steps_ms, exposed)])


def test_overlap_saving_worked_by_hand():
    # rank medians: off 110 and 130 ms (mean 120), on 90 and 90 (mean 90): 25 % saved;
    # exposed: off 40 and 60 (mean 50), on 10 and 20 (mean 15)
    off = [_record([100, 110, 120], [40, 40, 50]), _record([130, 125, 140], [60, 70, 50])]
    on = [_record([90, 95, 80], [10, 5, 20]), _record([90, 90, 90], [20, 20, 20])]
    result = dp_overlap.DPOverlapResult(
        d=2, modes=["all-reduce", "all-reduce + overlap"], bucket_size=1, train_argv=[],
        reports=[{"device": "cpu", "modes": {"all-reduce": a, "all-reduce + overlap": b}}
                 for a, b in zip(off, on)], wall_s=0.0)
    assert dp_overlap.overlap_saving(result) == [dict(
        mode="all-reduce", step_ms=120, step_overlap_ms=90, exposed_ms=50,
        exposed_overlap_ms=15, saved_pct=25)]
    assert dp_overlap.format_saving(result) == (
        "all-reduce: step 120 ms -> 90 ms with overlap (+25 % saved); exposed communication "
        "50 ms -> 15 ms (mean of 2 ranks, cpu)")
    with pytest.raises(KeyError, match="'distributed optimizer' was not run"):
        result.mode("distributed optimizer")


def test_bucket_table_and_lab08_views(result):
    table = dp_overlap.format_buckets(result)
    assert "decoder.final_layernorm.bias ..\n" in table
    assert ".. decoder.layers.1.mlp.linear_fc1.weight\n" in table     # first and last, a line each
    assert max(len(line) for line in table.splitlines()) <= 100
    assert f"4 buckets of about {BUCKET_SIZE} elements;\n{GRAD_ELEMENTS} gradient elements" in table
    for mode in result.modes:                    # lab 15's StepTimer booked the DP collectives
        assert any(k.startswith("dp ") for k in result.mode(mode)[0]["breakdown"]["parts"])
    with pytest.raises(ValueError, match="profile=True"):
        dp_overlap.kernel_timelines(result)      # traces only when asked for


def test_timeline_draws_the_ranks_asked_for(result):
    ax = plot_dp_timeline(result, modes=[OVERLAP], ranks=[2]).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == \
        ["rank 2 backward"] + [f"bucket {b}" for b in range(len(BUCKETS))]
    assert "ranks 2 shown" in ax.get_xlabel()
    with pytest.raises(ValueError, match="subset of 0..3"):
        plot_dp_timeline(result, ranks=[4])


def _sweep_result(buckets, backward, exposed_off, exposed_on):
    rec = lambda exposed: dict(  # noqa: E731
        buckets=[dict(padded=n) for n in buckets], grad_numel_padded=sum(buckets),
        steps=[dict(step_ms=backward + exposed, backward_ms=backward, exposed_ms=exposed)])
    return dp_overlap.DPOverlapResult(
        d=2, modes=["all-reduce", "all-reduce + overlap"], bucket_size=buckets[0],
        train_argv=[], wall_s=0.0,
        reports=[{"device": "cpu", "core": k, "modes": {"all-reduce": rec(exposed_off),
                                                       "all-reduce + overlap": rec(exposed_on)}}
                 for k in range(2)])


def test_sweep_rows_fit_the_channel_and_run_the_model_worked_by_hand():
    # d = 2, alpha 1 ms per ring step (2 steps), 1 byte per us: 1000 fp32 elements = 4 ms.
    # 4 buckets of 1000: off = 4 x 2 + 16 = 24 ms; 1 bucket of 4000: off = 2 + 16 = 18 ms
    results = {1000: _sweep_result([1000] * 4, 40, 24, 10),
               4000: _sweep_result([4000], 40, 18, 18)}
    rows = dp_overlap.sweep_rows(results)
    assert [r["buckets"] for r in rows] == [4, 1]
    assert rows[0]["channel"]["alpha_s"] == pytest.approx(1e-3)
    assert rows[0]["channel"]["busbw"] == pytest.approx(1e6)
    # the model: bucket i ready at 10 (i + 1) ms, each 6 ms long: the last ends at 46: 6 exposed
    assert rows[0]["model_on_s"] == pytest.approx(6e-3)
    assert rows[1]["model_on_s"] == pytest.approx(18e-3)      # one bucket: nothing to overlap
    table = dp_overlap.format_sweep(rows)
    assert "alpha 1000 us per ring step, bus bandwidth 0.00 GB/s" in table
    assert overlap_model.fit_channel(rows, 2)["alpha_s"] == pytest.approx(1e-3)


def test_the_overlap_verdict_says_plainly_what_the_cpu_showed(capsys):
    dp_lessons.print_overlap_verdict(_sweep_result([1000], 40, 20, 20))
    out = capsys.readouterr().out
    assert out.startswith("measured on d = 2 ranks (cpu, each pinned to a core of its own")
    assert "this machine shows no clear saving. On a CPU it cannot show the GPU's" in " ".join(
        out.split())
    assert max(len(line) for line in out.splitlines()) <= 100
    dp_lessons.print_overlap_verdict(_sweep_result([1000], 40, 30, 5))
    assert "this machine shows a saving." in capsys.readouterr().out


def test_timing_ranks_fit_the_cores():
    cores = len(rank_clock.usable_cores())
    assert dp_lessons.timing_ranks(8, "cuda") == 8
    assert dp_lessons.timing_ranks(8, "cpu") == max(2, min(8, cores))
    assert dp_lessons.timing_ranks(2, "cpu") == 2


def test_the_memory_table_merges_ranks_that_measured_the_same(capsys):
    row = lambda rank, m: dict(config="t=1 p=1 d=4", optimizer="AdamW", rank=rank,  # noqa: E731
                               term="parameters", measured=m, predicted=1024)
    dp_lessons.print_memory_table([row(0, 2048), row(1, 2048), row(2, 2048), row(3, 1024)])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4                     # title, header, ranks 0-2, rank 3
    assert lines[2].split()[4:6] == ["0-2", "2.0/1.0"] and lines[3].split()[4] == "3"
