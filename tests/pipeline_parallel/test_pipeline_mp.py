"""Pipeline parallelism on 4 real ranks (gloo): p2p wrappers, and GPipe / 1F1B / interleaved at
PP=4 and PP=2 x DP=2 (and two edge cases: m = p interleaved, m < p 1F1B) against the
single-process toy model (losses, every gradient, the tied embedding); the order each rank
executed, recorded from outside with hooks, against the planner's ``schedule_order``; peak
in-flight activations; and the measured bubble."""
import math

import pytest

from mpu_lab.labkit.pipeline_parallel.viz import plot_gantt
from mpu_lab.perf.pipeline_timeline import measured_bubble
from mpu_lab.perf.pipeline_order import schedule_order

pytestmark = pytest.mark.slow
RTOL = 1e-5
# As in mp/pipeline_checks.py: (PP, v, schedule, micro-batches per replica or None)
RUNS = [(4, None, "gpipe", None), (4, None, "1f1b", None), (4, 2, "interleaved", None),
        (2, None, "gpipe", None), (2, None, "1f1b", None), (2, 2, "interleaved", None),
        (4, 2, "interleaved", 4), (4, None, "1f1b", 2)]
IDS = [f"pp{p}-{s}" + (f"-m{m}" if m else "") for p, _, s, m in RUNS]
FUNCTIONS = {"gpipe": "forward_backward_pipelining_gpipe",
             "1f1b": "forward_backward_pipelining_without_interleaving",
             "interleaved": "forward_backward_pipelining_with_interleaving"}
# Most micro-batch activations a stage holds, worked by hand: GPipe all m; 1F1B p - r (its
# warm-up forwards and one more), at most m; interleaved with p = 4, v = 2, m = 8: the
# warm-up 2(p - r - 1) + (v - 1)p chunk forwards and one more; with m = p all m·v = 8.
PEAKS = {(4, None, "gpipe", None): [8, 8, 8, 8], (4, None, "1f1b", None): [4, 3, 2, 1],
         (4, 2, "interleaved", None): [11, 9, 7, 5], (2, None, "gpipe", None): [4, 4],
         (2, None, "1f1b", None): [2, 1], (2, 2, "interleaved", None): [5, 3],
         (4, 2, "interleaved", 4): [8, 8, 8, 8], (4, None, "1f1b", 2): [2, 2, 2, 1]}


@pytest.fixture(scope="module")
def reports(four_rank_job):
    """Each rank's dict from tests/mp/pipeline_checks.py's checks, run in the shared 4-rank
    job (tests/mp/four_rank_checks.py; ``four_rank_job`` in conftest.py)."""
    return [rep["pipeline"] for rep in four_rank_job[0]]


@pytest.mark.parametrize("pp", [4, 2])
def test_p2p_wrappers_carry_activations_forward_and_gradients_back(reports, pp):
    weights = [k + 2 for k in range(pp)]            # stage k multiplies by k + 2
    for rank, report in enumerate(reports):
        got = report["p2p"][str(pp)]
        r = rank // (4 // pp)                       # pipeline rank (order tp-cp-dp-pp)
        assert got["forward_value"] == math.prod(weights[:r])
        assert got["weight_grad"] == math.prod(weights[:r]) * math.prod(weights[r + 1:])
        assert (got["sends"], got["recvs"]) == ((1, 1) if r in (0, pp - 1) else (2, 2))
        assert got["ring_ok"], (pp, rank)
        assert "(5,)" in got["shape_error"] and "(2, 3, 4)" in got["shape_error"]


@pytest.mark.parametrize("index", range(len(RUNS)), ids=IDS)
def test_losses_and_gradients_equal_the_single_process_model(reports, index):
    pp, vpp, schedule, _ = RUNS[index]
    last_stage_ranks = 0
    for report in reports:
        got = report["runs"][index]
        assert (got["pp"], got["vpp"], got["schedule"]) == (pp, vpp, schedule)
        assert got["fn"] == FUNCTIONS[schedule]
        assert got["emb_synced"]                                   # last stage's copy == first's
        assert max(got["grad_rel"]) <= RTOL, got["grad_rel"]       # incl. the tied embedding
        if got["pp_rank"] == pp - 1:
            last_stage_ranks += 1
            assert len(got["loss_rel"]) == 3 and max(got["loss_rel"]) <= RTOL
            assert got["eval_rel"] <= RTOL                          # forward_only
        else:
            assert got["loss_rel"] == []
        assert got["eval_no_grads"]
    assert last_stage_ranks == 4 // pp                             # one per data-parallel replica


@pytest.mark.parametrize("index", range(len(RUNS)), ids=IDS)
def test_the_executed_order_recorded_from_outside_equals_schedule_order(reports, index):
    """The schedules run Megatron's loops, not the planner's list: the order a recorder hooked
    on the model chunks saw must still be the planner's, for training and forward-only."""
    pp, vpp, schedule, _ = RUNS[index]
    v = vpp or 1
    for report in reports:
        got = report["runs"][index]
        r, m = got["pp_rank"], got["m"]
        assert [rec[:3] for rec in got["records"]] == \
            [list(op) for op in schedule_order(schedule, pp, r, m, v)]
        assert got["eval_order"] == [list(op) for op in schedule_order(schedule, pp, r, m, v, True)]
        for _, _, _, start, end in got["records"]:
            assert end >= start


@pytest.mark.parametrize("index", range(len(RUNS)), ids=IDS)
def test_measured_peak_in_flight_activations(reports, index):
    for report in reports:
        got = report["runs"][index]
        assert got["peak_in_flight"] == PEAKS[RUNS[index]][got["pp_rank"]]


def test_wall_clock_timeline_is_drawn_with_the_measured_bubble(reports, tmp_path):
    index = RUNS.index((4, None, "1f1b", None))
    records = [[tuple(rec) for rec in report["runs"][index]["records"]] for report in reports]
    got = measured_bubble(records, num_microbatches=8)
    assert got["analytic_share"] == pytest.approx(3 / 11)
    assert 0.0 < got["measured_share"] < 1.0                       # indicative on a shared CPU
    fig = plot_gantt(records, title="1F1B, p=4, m=8 (measured)", time_unit="ms")
    fig.savefig(tmp_path / "gantt.png")
    assert (tmp_path / "gantt.png").stat().st_size > 0
    assert len(fig.axes[0].collections) == 4 * 16
