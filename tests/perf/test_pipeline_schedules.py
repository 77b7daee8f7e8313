"""Idle unit slots per rank (mpu_lab.perf.pipeline_schedules, F = B = W = 1) against the zero-bubble
paper's figures (Qi et al. 2024: 1F1B 3(p - 1), ZB-H1 p - 1) and against torch's own orders
(torch.distributed.pipelining's ScheduleInterleavedZeroBubble with one stage per rank, and
ScheduleZBVZeroBubble), simulated by the same dependency rules."""
import pytest

from mpu_lab.core.pipeline_parallel.action_lists import Action, pipeline_actions
from mpu_lab.perf.pipeline_schedules import (
    idle_from_slots, idle_slots, schedule_actions, simulate)
from torch_pipelining import torch_orders


SIZES = [(2, 4), (2, 8), (3, 5), (4, 8), (4, 12), (8, 16)]


@pytest.mark.parametrize("p,m", SIZES)
def test_1f1b_leaves_three_times_p_minus_one_idle_slots_on_every_rank(p, m):
    assert idle_slots("1F1B", p, m) == [3 * (p - 1)] * p          # the paper's §2, Fig. 2
    assert idle_slots("GPipe", p, m) == [3 * (p - 1)] * p          # the same bubble, more memory


@pytest.mark.parametrize("p,m", SIZES)
def test_zbh1_leaves_p_minus_one_idle_slots_as_torch_s_interleaved_zero_bubble(p, m):
    assert idle_slots("ZBH1", p, m) == [p - 1] * p                 # the paper's §3.1
    assert idle_from_slots(simulate(torch_orders("ZBH1", p, m))) == [p - 1] * p


@pytest.mark.parametrize("p,m", SIZES + [(4, 7), (4, 4), (2, 2), (4, 3)])
def test_zbv_leaves_no_more_idle_slots_than_torch_s_zbv(p, m):
    ours = idle_slots("ZBVZeroBubble", p, m)
    theirs = idle_from_slots(simulate(torch_orders("ZBVZeroBubble", p, m), layout="v"))
    assert all(a <= b for a, b in zip(ours, theirs)), (ours, theirs)
    if m >= 2 * p - 1:                     # the full V: p - 1 slots of half a stage each
        assert ours == [p - 1] * p


def test_interleaved_uses_the_planner_order_with_two_chunks_by_default():
    # Fig. 4 of Narayanan et al. 2021: the bubble in stage-sized units shrinks by v; in chunk
    # units (half a stage at v = 2) the count of idle slots is 1F1B's.
    assert idle_slots("Interleaved1F1B", 4, 8) == [9] * 4
    assert idle_slots("Interleaved1F1B", 2, 4, num_model_chunks=4) == [3] * 2


def test_a_hand_worked_1f1b_at_two_stages_and_two_microbatches():
    # slot:    0  1  2  3  4  5  6  7  8
    # rank 0:  F0 F1 .  .  B0 B0 .  B1 B1     (B0 waits for rank 1's B0, B1 for its B1)
    # rank 1:  .  F0 B0 B0 F1 B1 B1 .  .      -> makespan 9, busy 6 each: 3 idle = 3(p - 1)
    placed = simulate(schedule_actions("1F1B", 2, 2))
    assert [(s.action.kind, s.start) for s in placed[0]] == [("F", 0), ("F", 1), ("BW", 4),
                                                             ("BW", 7)]
    assert [(s.action.kind, s.start) for s in placed[1]] == [("F", 1), ("BW", 2), ("F", 4),
                                                             ("BW", 5)]
    assert idle_from_slots(placed) == [3, 3]


def test_an_order_that_waits_on_itself_is_refused():
    stuck = {0: [Action("B", 0, 0), Action("F", 0, 0)], 1: [Action("F", 0, 0), Action("B", 0, 0)]}
    with pytest.raises(ValueError, match="wait on each other"):
        simulate(stuck)


@pytest.mark.parametrize("schedule,pp,m,match", [
    ("ZBX", 2, 4, "unknown schedule 'ZBX'.*ZBVZeroBubble"),
    ("DualPipeV", 2, 4, "DualPipeV's overlapped"),
    ("1F1B", 0, 4, "pp must be a positive integer, got 0"),
    ("ZBH1", 2, 0, "ZBH1 at pp=2 needs num_microbatches >= 1, got 0"),
    ("Interleaved1F1B", 4, 2, "needs num_microbatches >= 4, got 2"),
    ("Interleaved1F1B", 4, 6, "divisible by pp=4"),
])
def test_bad_arguments_are_refused_naming_the_values(schedule, pp, m, match):
    with pytest.raises(ValueError, match=match):
        idle_slots(schedule, pp, m)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12)])
def test_dualpipev_is_torch_s_list_and_played_pair_by_pair_leaves_zbv_s_idle_slots(p, m):
    ours = pipeline_actions("DualPipeV", p, m)
    assert ours == torch_orders("DualPipeV", p, m)       # an overlapped pair: F, then BW
    assert idle_from_slots(simulate(ours, layout="v")) == [p - 1] * p
