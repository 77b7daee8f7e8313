"""ZBH1, ZBVZeroBubble and DualPipeV on 4 real ranks (gloo), in one torchrun job (tests/mp/zero_bubble_checks.py):
at PP=2 x DP=2, PP=4 and TP=2 x PP=2 (with and without sequence parallelism), each over m = 2p
micro-batches per replica, the loss and every gradient equal the one-process GPT's
(<= 1e-5) and 1F1B's run at the same layout; each rank ran exactly its action list (recorded
through the schedules' action_callback), and the weight gradients of the linear layers waited
for the W.
Through the training loop (PP=2 x DP=2): the schedule names stored as torch's, the losses of
1F1B, ZBH1, ZBVZeroBubble and DualPipeV equal, ``--timeline-file`` holding each pipeline rank's actions of
the last iteration, and a ZBV checkpoint resumed under 1F1B continuing 1F1B's losses."""
import json
import pathlib

import pytest

from mpu_lab.core.pipeline_parallel.action_lists import rank_actions
from mpu_lab.perf.pipeline_order import schedule_order

pytestmark = pytest.mark.slow
RTOL = 1e-5
LAYOUTS = [(1, 2, False), (1, 4, False), (2, 2, False), (2, 2, True)]
IDS = [f"tp{t}pp{p}" + ("sp" if s else "") for t, p, s in LAYOUTS]
SCHEDULES = ("1F1B", "ZBH1", "ZBVZeroBubble", "DualPipeV")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from mpu_lab.launcher import run
    folder = tmp_path_factory.mktemp("zero_bubble")
    result = run(pathlib.Path(__file__).parent.parent / "mp" / "zero_bubble_checks.py",
                 [str(folder)], nproc=4, timeout_s=400, show="none")
    assert [rep["rank"] for rep in result.results] == list(range(4))
    return result.results, folder


@pytest.fixture(scope="module")
def reports(job):
    return job[0]


def runs(reports, tp, pp, sp, schedule):
    return [next(r for r in rep["runs"]
                 if (r["tp"], r["pp"], r["sp"], r["schedule"]) == (tp, pp, sp, schedule))
            for rep in reports]


@pytest.mark.parametrize("tp,pp,sp", LAYOUTS, ids=IDS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_losses_and_gradients_equal_the_one_process_model_and_1f1b(reports, tp, pp, sp, schedule):
    got = runs(reports, tp, pp, sp, schedule)
    for rank in got:
        assert rank["grad_rel"] <= RTOL, rank
        assert rank["vs_1f1b"] <= RTOL, rank
    # The loss is where the last stage is: pipeline rank p - 1, or rank 0 in a V.
    last = 0 if schedule in ("ZBVZeroBubble", "DualPipeV") else pp - 1
    with_loss = [rank for rank in got if rank["loss_rel"] is not None]
    assert {rank["pp_rank"] for rank in with_loss} == {last}
    assert len(with_loss) == 4 // pp                     # one per data-parallel x TP rank
    assert max(rank["loss_rel"] for rank in with_loss) <= RTOL
    # forward_only (evaluation): the same loss on the same ranks, and no gradient anywhere
    assert [rank["eval_rel"] is not None for rank in got] == [rank["loss_rel"] is not None
                                                              for rank in got]
    assert max(rank["eval_rel"] for rank in with_loss) <= RTOL
    assert all(rank["eval_no_grads"] for rank in got)


@pytest.mark.parametrize("tp,pp,sp", LAYOUTS, ids=IDS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_rank_ran_its_action_list_and_w_computed_what_b_left(reports, tp, pp, sp, schedule):
    for rank in runs(reports, tp, pp, sp, schedule):
        r, m = rank["pp_rank"], rank["m"]
        if schedule == "1F1B":      # Megatron's loop, reported as unsplit backwards
            expected = [["BW" if op.kind == "B" else "F", op.microbatch, op.chunk]
                        for op in schedule_order("1f1b", pp, r, m)]
        else:
            expected = [list(a) for a in rank_actions(schedule, pp, r, m)]
        assert rank["actions"] == expected
        if schedule in ("ZBH1", "ZBVZeroBubble"):
            # At the first W, B had left its chunk's linear weights without a gradient (and
            # given the LayerNorms theirs); the gradients above show W then computed them.
            assert rank["deferred_at_first_w"] is True


def test_training_stores_torch_s_names_and_every_schedule_gives_1f1b_s_losses(reports):
    for rep in reports:
        got = rep["training"]
        assert [got[k][0] for k in ("1f1b", "zbh1", "ZBVZeroBubble", "dualpipev")] == \
            ["1F1B", "ZBH1", "ZBVZeroBubble", "DualPipeV"]
        reference = got["1f1b"][1]
        assert len(reference) == 3
        for name in ("zbh1", "ZBVZeroBubble", "dualpipev"):
            assert max(abs(a - b) / b for a, b in zip(got[name][1], reference)) <= RTOL
        # ZBV saved after 1 iteration, resumed under 1F1B: 1F1B's iterations 2 and 3.
        assert len(got["zbv_saved"][1]) == 1 and len(got["resumed_1f1b"][1]) == 2
        assert max(abs(a - b) / b for a, b in zip(got["zbv_saved"][1], reference[:1])) <= RTOL
        assert max(abs(a - b) / b for a, b in zip(got["resumed_1f1b"][1], reference[1:])) <= RTOL


@pytest.mark.parametrize("given,schedule", [("1f1b", "1F1B"), ("zbh1", "ZBH1"),
                                            ("ZBVZeroBubble", "ZBVZeroBubble"),
                                            ("dualpipev", "DualPipeV")])
def test_the_timeline_file_holds_each_pipeline_rank_s_actions_of_the_last_iteration(
        job, given, schedule):
    timeline = json.loads((job[1] / given / "timeline.json").read_text())
    m = 4                                               # 8 micro-batches over DP = 2
    if schedule == "1F1B":
        expected = {str(r): [["BW" if op.kind == "B" else "F", op.microbatch, op.chunk]
                             for op in schedule_order("1f1b", 2, r, m)] for r in range(2)}
    else:
        expected = {str(r): [list(a) for a in rank_actions(schedule, 2, r, m)] for r in range(2)}
    assert timeline == expected
