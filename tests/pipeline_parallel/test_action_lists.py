"""The zero-bubble action lists (mpu_lab.core.pipeline_parallel.action_lists): every micro-batch's
F, B and W once per chunk (DualPipeV's BW counting as both), in micro-batch order, W after its
B; the same lists as torch's own generators build; an order that can run (the dependency
simulation of mpu_lab.perf.pipeline_schedules plays it out); ZB-H1's peak activations are
1F1B's; and the V's stage layout."""
import pytest

from mpu_lab.core.pipeline_parallel.action_lists import (
    pipeline_actions, rank_actions, rank_and_chunk_of, stage_of, zbh1_actions)
from mpu_lab.core.pipeline_parallel.partition import check_layers_v, v_stage_table
from mpu_lab.perf.pipeline_schedules import simulate
from torch_pipelining import torch_orders


CASES = [(s, p, m) for s in ("ZBH1", "ZBVZeroBubble") for p, m in
         [(1, 3), (2, 2), (2, 4), (3, 5), (4, 4), (4, 8), (4, 9)]] + \
    [("DualPipeV", p, m) for p, m in [(1, 2), (2, 4), (3, 7), (4, 8), (4, 12)]]


@pytest.mark.parametrize("schedule,p,m", CASES)
def test_each_chunk_runs_f_b_w_of_every_microbatch_once_in_order(schedule, p, m):
    chunks = 1 if schedule == "ZBH1" else 2
    pipeline = pipeline_actions(schedule, p, m)
    for r, actions in pipeline.items():
        for c in range(chunks):
            for kind in "FBW":
                assert [a.microbatch for a in actions
                        if kind in a.kind and a.chunk == c] == list(range(m)), (r, c, kind)
            seen = set()
            for a in actions:
                if a.chunk == c:
                    needs = {"B": "F", "W": "B", "BW": "F"}.get(a.kind)
                    assert needs is None or any((k, a.microbatch) in seen
                                                for k in (needs, "BW")), (r, a)
                    seen.add((a.kind, a.microbatch))
    simulate(pipeline, "loop" if schedule == "ZBH1" else "v")     # raises if it cannot run


@pytest.mark.parametrize("schedule,p,m", [c for c in CASES if c[1] > 1])
def test_the_lists_equal_torch_s_generators(schedule, p, m):
    assert pipeline_actions(schedule, p, m) == torch_orders(schedule, p, m)


def test_zbh1_by_hand_and_its_peak_activations_are_1f1b_s():
    text = " ".join(f"{a.kind}{a.microbatch}" for a in zbh1_actions(4, 1, 4))
    assert text == "F0 F1 F2 B0 F3 B1 W0 B2 W1 B3 W2 W3"        # rank 1 holds back 1 W
    for r in range(4):                                            # in flight: F done, B not
        flight, peak = 0, 0
        for a in zbh1_actions(4, r, 8):
            flight += {"F": 1, "B": -1}.get(a.kind, 0)
            peak = max(peak, flight)
        assert peak == 4 - r


def test_the_v_puts_the_first_and_the_last_stage_on_rank_0():
    assert [stage_of(c, r, 3, "v") for r in range(3) for c in (0, 1)] == [0, 5, 1, 4, 2, 3]
    assert all(rank_and_chunk_of(stage_of(c, r, 3, "v"), 3, "v") == (r, c)
               for r in range(3) for c in (0, 1))
    rows = v_stage_table(8, 2)
    assert [(x["pp_rank"], x["chunk"], x["pre_process"], x["post_process"]) for x in rows] == \
        [(0, 0, True, False), (1, 0, False, False), (1, 1, False, False), (0, 1, False, True)]
    with pytest.raises(ValueError, match="num_layers 6 is not divisible by 2 x "
                                         "pipeline_model_parallel_size 2 = 4"):
        check_layers_v(6, 2)


def test_dualpipev_pairs_a_forward_with_another_microbatch_s_whole_backward():
    text = " ".join(f"{a.kind}{a.microbatch}.{a.chunk}" for a in pipeline_actions("DualPipeV", 2, 4)[1])
    # The last rank of 2, worked by hand from the steps: 2. F0 F1 twice; 4. the pairs F0+BW1,
    # F1+BW0 twice (the last rank's first F0, BW1 not paired, as in torch); 6. BW1 BW0, then
    # B1 B0 split from half-way; 8. the two W's queued.
    assert text == "F0.0 F0.1 F1.0 F1.1 F2.0 BW0.1 F2.1 BW0.0 F3.0 BW1.1 F3.1 BW1.0 " \
                   "BW2.1 BW2.0 B3.1 B3.0 W3.1 W3.0"
    with pytest.raises(ValueError, match="DualPipeV needs num_microbatches >= 2 x pipeline "
                                         "size = 4, got 3"):
        rank_actions("DualPipeV", 2, 0, 3)


def test_unknown_schedule_and_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="no action list for schedule '1F1B'"):
        rank_actions("1F1B", 2, 0, 4)
    with pytest.raises(ValueError, match="pipeline size 2, rank 2"):
        rank_actions("ZBH1", 2, 2, 4)
