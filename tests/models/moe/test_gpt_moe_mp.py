"""launch/train_gpt.py with --num-experts (every MLP a mixture-of-experts layer) under expert
parallelism: per-iteration losses and gradient norms equal the EP=1 run of the same flags at
EP = 2, EP = 4 (both dispatchers), EP = 2 with TP = 2 and sequence parallelism (etp = 2 and
etp = 1), EP = 2 x PP = 2, and top-1 routing with the load-balancing loss; the EP=1 run
itself equals a one-process run of train_gpt.py (no data or expert parallelism). One 4-rank
torchrun job (tests/mp/gpt_moe_checks.py), whose reports every test reads; in it a checkpoint
saved at EP=2 resumes at EP=4, at EP=1, at TP=2 x EP=2 with the experts split etp=2 and at
EP=2 x PP=2; the distributed optimizer (saving, resuming, and training: a second gradient
buffer for the experts over expert-DP) and --overlap-grad-reduce give the same losses too."""
import pytest

from mpu_lab.launcher import run
from mp_reports import job_reports, rel_diff

pytestmark = pytest.mark.slow
RTOL = 1e-5


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return job_reports("gpt_moe_checks.py", tmp_path_factory, "moe_ckpt")


# name: (tp, pp, dp, ep, etp, edp) at 4 ranks; edp = 4 / (etp x ep x pp)
SIZES = {"ep2": (1, 1, 4, 2, 1, 2), "ep4": (1, 1, 4, 4, 1, 1), "ep4_allgather": (1, 1, 4, 4, 1, 1),
         "tp2_sp_ep2": (2, 1, 2, 2, 2, 1), "tp2_sp_ep2_etp1": (2, 1, 2, 2, 1, 2),
         "ep2_pp2": (1, 2, 2, 2, 1, 1), "ep4_aux_top1": (1, 1, 4, 4, 1, 1),
         "ep2_distopt": (1, 1, 4, 2, 1, 2), "tp2_sp_ep2_etp1_distopt": (2, 1, 2, 2, 1, 2),
         "ep4_overlap": (1, 1, 4, 4, 1, 1), "ep2_pp2_distopt": (1, 2, 2, 2, 1, 1)}


@pytest.mark.parametrize("name", list(SIZES))
def test_losses_and_grad_norms_equal_the_ep1_run(reports, name):
    for r in reports:
        run_ = r["runs"][name]
        assert run_["ok"], run_.get("traceback")
        keys = ("tp", "pp", "dp", "ep", "etp", "edp")
        assert run_["sizes"] == dict(zip(keys, SIZES[name]))
        reference = r["runs"][r["references"][name]]
        assert len(run_["losses"]) == 5
        assert rel_diff(run_["losses"], reference["losses"]) <= RTOL
        assert rel_diff(run_["grad_norms"], reference["grad_norms"]) <= RTOL


def test_the_load_balancing_loss_changes_the_training(reports):
    # top-1 with coefficient 0.1 against top-2 without: the runs differ from the first step's
    # gradient on (the aux loss's gradient reaches the router)
    aux, plain = reports[0]["runs"]["ep1_aux_top1"], reports[0]["runs"]["ep1"]
    assert abs(aux["grad_norms"][0] - plain["grad_norms"][0]) > 1e-3


def test_the_logged_load_balancing_loss_is_the_same_at_ep4_and_ep1(reports):
    # logged only with --moe-aux-loss-coeff; 1 for a uniform load, E = 4 for one expert
    assert reports[0]["runs"]["ep1"]["load_balancing"] == [None] * 5
    for r in reports:
        ep1, ep4 = (r["runs"][n]["load_balancing"] for n in ("ep1_aux_top1", "ep4_aux_top1"))
        assert all(0.5 < x < 4 for x in ep1)
        assert rel_diff(ep4, ep1) <= RTOL


def test_the_ep1_run_equals_a_one_process_run(reports):
    # the reference itself against train_gpt.py in one process: 4 micro-batches of 2, no
    # data-parallel or expert-parallel reduction at all
    one = run("train_gpt.py", reports[0]["flags"]["ep1"], nproc=1, timeout_s=120, show="none")
    losses = [m["lm_loss"] for m in one.results[0]["metrics"]]
    assert rel_diff(reports[0]["runs"]["ep1"]["losses"], losses) <= RTOL


def test_losses_learn(reports):
    losses = reports[0]["runs"]["ep1"]["losses"]
    assert losses[-1] < losses[0] - 0.05


@pytest.mark.parametrize("name", ["ep4", "ep1", "tp2_sp_ep2", "ep2_pp2_distopt"])
def test_a_checkpoint_saved_at_ep2_resumes_at_another_layout(reports, name):
    for r in reports:
        resumed = r["resumed"][name]
        assert resumed["iteration"] == 3
        assert len(resumed["losses"]) == 2
        assert rel_diff(resumed["losses"], r["resume_reference"]) <= RTOL
