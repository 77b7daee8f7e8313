"""launch/train_gpt.py's training with --context-parallel-size against the TP=1, CP=1 run and
its dense twin (PlainGPT in one process, same initial weights), at CP = 2, CP = 4, TP = 2 x
CP = 2, CP = 2 x PP = 2, each --cp-comm-type, with sequence parallelism and the distributed
optimizer; a checkpoint saved at CP = 2 (distributed optimizer) resumed at CP = 1. One 4-rank torchrun job
(tests/mp/gpt_cp_checks.py), whose reports every test reads."""
import pytest

from mp_reports import job_reports, rel_diff

pytestmark = pytest.mark.slow
RTOL = 1e-5


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return job_reports("gpt_cp_checks.py", tmp_path_factory, "cp_ckpt")


# name: (TP, CP, PP, DP) at 4 ranks
SIZES = {"cp2": (1, 2, 1, 2), "cp4": (1, 4, 1, 1), "tp2_cp2": (2, 2, 1, 1),
         "cp2_pp2": (1, 2, 2, 1), "cp2_allgather_distopt": (1, 2, 1, 2), "cp4_a2a": (1, 4, 1, 1),
         "tp2_cp2_sp_a2a": (2, 2, 1, 1)}


@pytest.mark.parametrize("name", list(SIZES))
def test_losses_equal_the_tp1_cp1_run_and_the_dense_twin(reports, name):
    for r in reports:
        run_ = r["runs"][name]
        assert run_["ok"], run_.get("traceback")
        tp, cp, pp, dp = SIZES[name]
        assert run_["sizes"] == dict(tp=tp, cp=cp, pp=pp, dp=dp, dp_cp=dp * cp)
        assert len(run_["losses"]) == 8
        assert rel_diff(run_["losses"], r["runs"]["tp1_cp1"]["losses"]) <= RTOL
        assert rel_diff(run_["losses"], r["dense_losses"]) <= RTOL
    assert reports[0]["runs"][name]["same_initial_weights"] is True   # CP leaves weights whole


def test_the_reference_run_matches_its_dense_twin_and_learns(reports):
    losses = reports[0]["runs"]["tp1_cp1"]["losses"]
    assert rel_diff(losses, reports[0]["dense_losses"]) <= RTOL
    assert losses[-1] < losses[0] - 0.2
    assert reports[0]["runs"]["cp2"]["micro_batches"] == 2                # with accumulation


def test_position_ids_follow_megatrons_layout(reports):
    # s = 32, cp = 2: 4 chunks of 8; rank r keeps chunks r and 3 - r. Global ranks 0 and 1
    # are the CP pair of data-parallel replica 0 (order tp-cp-dp-pp).
    assert reports[0]["cp_positions"] == list(range(0, 8)) + list(range(24, 32))
    assert reports[1]["cp_positions"] == list(range(8, 24))
    assert all(r["default_positions_equal"] for r in reports)


def test_checkpoint_saved_at_cp2_resumes_at_cp1(reports):
    for r in reports:
        assert r["loaded_iteration"] == 5
        assert rel_diff(r["resumed"], r["resume_reference"]) <= RTOL
    assert reports[0]["loaded_identical"] is True                         # bit-identical weights
