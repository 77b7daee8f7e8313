"""Pipeline parallelism without processes: partition, the checks before launch, the per-stage
op order, its message plan under NCCL's rules, the logical timeline's exact bubble, peak
in-flight activations, the recorder that watches a schedule from outside, and the Gantt
chart."""
from fractions import Fraction

import pytest
import torch

from mpu_lab.labkit.pipeline_parallel.viz import plot_gantt
from mpu_lab.perf.pipeline_timeline import ScheduleRecorder, measured_bubble, pipeline_records
from mpu_lab.perf.pipeline_simulation import analytic_bubble, bubble_share, simulate
from mpu_lab.core.pipeline_parallel import (
    canonical_schedule, check_layers, check_schedule, get_num_microbatches, layer_offset,
    partition_table, stage_layers, validate_pipeline_args,
    virtual_size_from_layers_per_virtual_stage)
from mpu_lab.perf.pipeline_order import schedule_order, verify_communication
from mpu_lab.perf.pipeline_order import num_warmup_ops, schedule_steps


def ops(order):
    return " ".join(f"{o.kind}{o.microbatch}" + (f".{o.chunk}" if o.chunk else "") for o in order)


# --------------------------------------------------------------------------- partition
def test_virtual_stage_k_of_rank_r_holds_layers_of_stage_k_times_p_plus_r():
    table = [(row["pp_rank"], row["chunk"], list(row["layers"]), row["pre_process"], row["post_process"])
             for row in partition_table(8, 2, 2)]
    assert table == [(0, 0, [0, 1], True, False), (1, 0, [2, 3], False, False),
                     (0, 1, [4, 5], False, False), (1, 1, [6, 7], False, True)]
    assert list(stage_layers(8, 4, 3)) == [6, 7]
    assert layer_offset(24, 4, 1, 3, 2) == (2 * 4 + 1) * 2
    assert check_layers(24, 4, 3) == 2


def test_layers_per_virtual_stage_flag_gives_the_virtual_size():
    assert virtual_size_from_layers_per_virtual_stage(8, 2, 2) == 2
    assert virtual_size_from_layers_per_virtual_stage(24, 4, 1) == 6
    got = validate_pipeline_args(num_layers=8, pipeline_model_parallel_size=2, global_batch_size=16,
                                 micro_batch_size=2, data_parallel_size=2,
                                 num_layers_per_virtual_pipeline_stage=2)
    assert got == dict(schedule="interleaved", num_microbatches=4,
                       virtual_pipeline_model_parallel_size=2, layers_per_chunk=2)
    assert validate_pipeline_args(num_layers=8, pipeline_model_parallel_size=1, global_batch_size=8,
                                  micro_batch_size=2, data_parallel_size=1)["schedule"] == "no-pipelining"


def test_schedule_names_and_aliases():
    assert [canonical_schedule(n) for n in ("GPipe", "afab", "1F1B", "interleaved-1f1b", "none")] == \
        ["gpipe", "gpipe", "1f1b", "interleaved", "no-pipelining"]


ERRORS = [
    (check_layers, (10, 4), ["num_layers 10", "pipeline_model_parallel_size 4"]),
    (check_layers, (8, 4, 4), ["num_layers 8", "virtual_pipeline_model_parallel_size 4", "= 16"]),
    (virtual_size_from_layers_per_virtual_stage, (8, 2, 3), ["num_layers_per_virtual_pipeline_stage 3",
                                                           "4 layers"]),
    (get_num_microbatches, (10, 2, 2), ["global_batch_size 10", "micro_batch_size 2",
                                        "data_parallel_size 2", "= 4"]),
    (check_schedule, ("interleaved", 4, 6, 2), ["6 micro-batches for 4 stages"]),
    (check_schedule, ("interleaved", 4, 2, 2), ["2 micro-batches for 4 stages"]),
    (check_schedule, ("interleaved", 1, 4, 2), ["pipeline_model_parallel_size >= 2, got 1"]),
    (check_schedule, ("interleaved", 4, 8, 1), ["model chunks per stage, got 1"]),
    (check_schedule, ("1f1b", 2, 4, 2), ["virtual_pipeline_model_parallel_size is 2"]),
    (check_schedule, ("no-pipelining", 2, 4), ["pipeline_model_parallel_size is 2"]),
    (check_schedule, ("zigzag", 2, 4), ["unknown pipeline schedule 'zigzag'", "gpipe"]),
    (check_schedule, ("1f1b", 2, 0), ["num_microbatches must be a positive integer, got 0"]),
]


@pytest.mark.parametrize("fn,args,fragments", ERRORS, ids=[f"{e[0].__name__}{e[1]}" for e in ERRORS])
def test_bad_configuration_raises_naming_the_numbers(fn, args, fragments):
    with pytest.raises(ValueError) as info:
        fn(*args)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_conflicting_virtual_flags_raise():
    with pytest.raises(ValueError, match="disagrees"):
        validate_pipeline_args(num_layers=8, pipeline_model_parallel_size=2, global_batch_size=8,
                               micro_batch_size=1, data_parallel_size=1,
                               virtual_pipeline_model_parallel_size=4,
                               num_layers_per_virtual_pipeline_stage=2)


# --------------------------------------------------------------------------- op order
def test_1f1b_warms_up_with_p_minus_r_minus_1_forwards():
    assert [num_warmup_ops("1f1b", 4, r, 8) for r in range(4)] == [3, 2, 1, 0]
    assert ops(schedule_order("1f1b", 4, 0, 6)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert ops(schedule_order("1f1b", 4, 3, 3)) == "F0 B0 F1 B1 F2 B2"
    assert ops(schedule_order("1f1b", 4, 0, 2)) == "F0 F1 B0 B1"          # m < p still runs
    assert ops(schedule_order("gpipe", 2, 1, 3)) == "F0 F1 F2 B0 B1 B2"
    assert ops(schedule_order("no-pipelining", 1, 0, 2)) == "F0 B0 F1 B1"


def test_interleaved_order_is_megatrons():
    # p=2, v=2, m=4, rank 0: warm-up 2(p-r-1) + (v-1)p = 4 forwards; chunks go in groups of p.
    assert ops(schedule_order("interleaved", 2, 0, 4, 2)) == \
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"
    # m == p: Megatron runs all forwards first.
    assert ops(schedule_order("interleaved", 2, 1, 2, 2)) == "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1"


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
def test_every_stage_runs_each_forward_and_backward_once_forward_first(schedule, v):
    p, m = 4, 8
    for r in range(p):
        order = schedule_order(schedule, p, r, m, v)
        assert sorted(order) == sorted({(k, i, c) for k in "FB" for i in range(m) for c in range(v)})
        for i in range(m):
            for c in range(v):
                assert order.index(("F", i, c)) < order.index(("B", i, c))
        assert schedule_order(schedule, p, r, m, v, forward_only=True) == \
            [o for o in order if o.kind == "F"]
        assert [o for s in schedule_steps(schedule, p, r, m, v) for o in s] == order


def test_message_plan_has_no_deadlock_and_matches_in_order_under_nccl_rules():
    checked = 0
    for schedule, vs in (("gpipe", [1]), ("1f1b", [1]), ("interleaved", [2, 3])):
        for p in (2, 3, 4):
            for m in (1, 2, 3, 4, 6, 8, 12):
                for v in vs:
                    if schedule == "interleaved" and m % p:
                        continue
                    for forward_only in (False, True):
                        n = verify_communication(schedule, p, m, v, forward_only)
                        # (p·v - 1) stage boundaries, each crossed by m activations (+ m grads)
                        assert n == (p * v - 1) * m * (1 if forward_only else 2)
                        checked += 1
    assert checked > 100


def test_one_message_batch_per_op_deadlocks_the_interleaved_schedule():
    assert verify_communication("1f1b", 4, 8, one_op_per_step=True) == 48
    with pytest.raises(RuntimeError, match="deadlocks"):
        verify_communication("interleaved", 4, 8, 2, one_op_per_step=True)


# --------------------------------------------------------------------------- the bubble
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_logical_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule):
    t = simulate(schedule, 4, 8)
    assert t.bubble_share == Fraction(3, 11)                        # (p-1)/(m+p-1), exactly
    assert t.makespan == 2 * (8 + 4 - 1)
    assert analytic_bubble(4, 8) == dict(relative=Fraction(3, 8), share=Fraction(3, 11))


def test_interleaving_divides_the_bubble_by_v():
    p, m, v = 4, 8, 2
    t = simulate("interleaved", p, m, v)
    ideal = 2 * m                                                    # F + B of m micro-batches
    assert (t.makespan - ideal) / ideal == Fraction(p - 1, v * m)    # Narayanan et al. (p-1)/(v·m)
    assert t.bubble_share == Fraction(p - 1, v * m + p - 1) == analytic_bubble(p, m, v)["share"]
    for p, m, v in [(2, 4, 2), (4, 16, 2), (4, 8, 4), (3, 6, 3)]:
        assert simulate("interleaved", p, m, v).bubble_share == analytic_bubble(p, m, v)["share"]


def test_1f1b_holds_at_most_p_activations_gpipe_holds_m():
    p, m = 4, 8
    assert simulate("1f1b", p, m).peak_in_flight == [4, 3, 2, 1]      # p - r
    assert simulate("gpipe", p, m).peak_in_flight == [m] * p
    assert simulate("1f1b", p, m, forward_only=True).peak_in_flight == [0] * p


def test_a_forward_only_pipeline_fills_and_drains_once():
    t = simulate("1f1b", 4, 8, forward_only=True)
    assert t.makespan == 8 + 4 - 1


def test_measured_bubble_of_ideal_records_equals_the_formula():
    t = simulate("1f1b", 4, 8)
    seconds = [[(k, i, c, float(s) * 0.01, float(e) * 0.01) for k, i, c, s, e in recs] for recs in t.records]
    got = measured_bubble(seconds, 8)
    assert got["measured_share"] == pytest.approx(3 / 11)
    assert got["analytic_share"] == pytest.approx(3 / 11) and got["analytic_relative"] == 3 / 8
    assert bubble_share(t.records) == Fraction(3, 11)


# --------------------------------------------------------------------------- the recorder
def test_recorder_sees_forwards_and_backwards_from_hooks_alone():
    """Two micro-batches through one chunk by hand, 1F1B-like: F0 F1 B0 B1. Only the hooks
    of the recorder watch; the second iteration starts afresh at F0."""
    torch.manual_seed(0)
    chunk = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    recorder = ScheduleRecorder(chunk, num_microbatches=2, schedule="1f1b")
    for _ in range(2):
        out0 = chunk(torch.randn(3, 4))
        out1 = chunk(torch.randn(3, 4))
        out0.sum().backward()
        out1.sum().backward()
    assert [r[:3] for r in recorder.records] == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]
    assert recorder.peak_in_flight == 2
    starts = [r[3] for r in recorder.records]
    assert starts == sorted(starts) and all(r[4] >= r[3] for r in recorder.records)
    with torch.no_grad():                      # forward-only: forwards, nothing held
        chunk(torch.randn(3, 4))
        chunk(torch.randn(3, 4))
    assert [r[:3] for r in recorder.records] == [("F", 0, 0), ("F", 1, 0)]
    assert recorder.peak_in_flight == 0
    recorder.remove()
    chunk(torch.randn(3, 4))
    assert len(recorder.records) == 2          # no hooks left


def test_recorder_numbers_chunks_in_the_order_given():
    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    with ScheduleRecorder(chunks, num_microbatches=1) as recorder:
        y = chunks[1](chunks[0](torch.ones(1, 2)))
        y.sum().backward()
    assert [r[:3] for r in recorder.records] == [("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)]
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer, got 0"):
        ScheduleRecorder(chunks, num_microbatches=0)


def test_pipeline_records_orders_the_stages_and_names_a_missing_timeline():
    def report(stage, dp_rank):
        return {"timeline": dict(pipeline_parallel_rank=stage, tensor_parallel_rank=0,
                                 data_parallel_rank=dp_rank, pipeline_parallel_size=2,
                                 schedule="1f1b", num_microbatches=1, num_model_chunks=1,
                                 peak_in_flight=1, records=[["F", 0, 0, stage, stage + 1]])}
    # Ranks in the order tp-cp-dp-pp: ranks 0, 1 are stage 0 of replicas 0, 1.
    tl = pipeline_records([report(0, 0), report(0, 1), report(1, 0), report(1, 1)],
                          data_parallel_rank=1)
    assert tl["ranks"] == [1, 3] and tl["records"] == [[("F", 0, 0, 0, 1)], [("F", 0, 0, 1, 2)]]
    assert (tl["schedule"], tl["num_microbatches"], tl["peak_in_flight"]) == ("1f1b", 1, [1, 1])
    with pytest.raises(ValueError, match="--record-timeline"):
        pipeline_records([{"metrics": []}, None])
    with pytest.raises(ValueError, match=r"stages \[1\] found, expected 0..1"):
        pipeline_records([None, report(1, 0)])


def test_gantt_chart_draws_one_box_per_op():
    t = simulate("interleaved", 4, 8, 2)
    fig = plot_gantt(t.records, title="interleaved, p=4, m=8, v=2")
    ax = fig.axes[0]
    assert len(ax.collections) == 4 * 2 * 8 * 2
    assert "15.8%" in ax.get_title()
    assert [label.get_text() for label in ax.get_yticklabels()] == [f"stage {i}" for i in (3, 2, 1, 0)]


@pytest.mark.parametrize("schedule", ["ZBH1", "zbvzerobubble", "DualPipeV"])
def test_the_planner_refuses_the_action_list_schedules_and_names_where_their_order_is(schedule):
    from mpu_lab.perf.pipeline_order import schedule_order
    with pytest.raises(ValueError, match="action_lists.pipeline_actions"):
        schedule_order(schedule, 2, 0, 4)
