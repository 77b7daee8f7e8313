"""launch/train_gpt.py's mixture-of-experts flags refused before any process starts (pure: no
job, no torch.distributed): training.validate_args and the launcher's pre-check name the
numbers and what would be valid; the flags reach the model's config."""
import pytest

from mpu_lab import training
from mpu_lab.launcher import LAUNCH_DIR
from mpu_lab.launcher.prechecks import precheck

TRAIN_GPT = LAUNCH_DIR / "train_gpt.py"
MOE = ["--num-experts", 4, "--moe-router-topk", 2]


def validate(flags, world_size):
    return training.validate_args(training.parse_args(flags), world_size)


def test_the_flags_reach_the_config_and_etp_defaults_to_tp():
    args = validate(MOE + ["--expert-model-parallel-size", 2, "--moe-token-dispatcher-type",
                           "allgather", "--moe-aux-loss-coeff", 0.01,
                           "--moe-expert-capacity-factor", 1.5], 4)
    cfg = training.model_config(args)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_token_dispatcher_type,
            cfg.moe_aux_loss_coeff, cfg.moe_expert_capacity_factor) == \
        (4, 2, "allgather", 0.01, 1.5)
    assert training.model_config(validate([], 1)).num_moe_experts is None
    # etp = t by default: TP=2 x EP=2 fills 4 ranks (etp x ep x edp x pp = 2 x 2 x 1 x 1)
    validate(MOE + ["--tensor-model-parallel-size", 2, "--sequence-parallel",
                    "--expert-model-parallel-size", 2], 4)


def test_experts_not_divisible_by_ep_are_refused_with_the_valid_sizes():
    # EP 3 and 6 divide the 6 experts but not the 8 ranks: not suggested
    with pytest.raises(ValueError, match=r"^--num-experts 6 is not divisible by "
                                         r"--expert-model-parallel-size 4: .*; valid with the "
                                         r"other flags as given: --expert-model-parallel-size 1 "
                                         r"or 2; or --num-experts 4 or 8$"):
        validate(["--num-experts", 6, "--expert-model-parallel-size", 4], 8)


def test_the_sizes_suggested_for_three_experts_on_four_ranks_fit_the_ranks():
    # issue 37: E = 3 at EP = 2 on 4 ranks used to suggest "valid sizes: [1, 3]", where EP 3
    # does not divide 4 ranks. By hand: EP must divide 3 and 4 -> 1; E must be a multiple of 2
    # (and >= top-k 2) -> the nearest, 2 or 4.
    with pytest.raises(ValueError) as err:
        validate(["--num-experts", 3, "--expert-model-parallel-size", 2], 4)
    assert err.value.fixes == {"--expert-model-parallel-size": [1], "--num-experts": [2, 4]}
    assert "num_moe_experts" not in str(err.value)
    for fix in (["--expert-model-parallel-size", 1], ["--num-experts", 2], ["--num-experts", 4]):
        validate(["--num-experts", 3, "--expert-model-parallel-size", 2] + fix, 4)


def test_topk_above_the_expert_count_is_refused():
    with pytest.raises(ValueError, match=r"--moe-router-topk 5 must be in 1\.\.--num-experts = "
                                         r"1\.\.4.*--moe-router-topk 2, 3 or 4; or "
                                         r"--num-experts 5$"):
        validate(["--num-experts", 4, "--moe-router-topk", 5], 1)


def test_a_world_not_divisible_by_etp_ep_pp_names_the_sizes_that_fit():
    with pytest.raises(ValueError, match=r"--expert-model-parallel-size 4 does not fit 6 "
                                         r"ranks: world size 6 is not divisible by expert-tensor "
                                         r"x expert-model x pipeline parallel size 1 x 4 x 1 = 4"
                                         r".*: --expert-model-parallel-size 1 or 2$"):
        validate(MOE + ["--expert-model-parallel-size", 4], 6)
    with pytest.raises(ValueError, match=r"2 x 2 x 2 = 8"):
        validate(MOE + ["--expert-model-parallel-size", 2, "--pipeline-model-parallel-size", 2,
                        "--expert-tensor-parallel-size", 2, "--num-layers", 4], 4)


def test_top1_softmax_needs_pre_softmax_and_tp_needs_sequence_parallel():
    with pytest.raises(ValueError, match=r"--moe-router-topk 1 with the softmax .*"
                                         r"add --moe-router-pre-softmax; or "
                                         r"--moe-router-score-function sigmoid$"):
        validate(["--num-experts", 4, "--moe-router-topk", 1], 1)
    validate(["--num-experts", 4, "--moe-router-topk", 1, "--moe-router-pre-softmax"], 1)
    with pytest.raises(ValueError, match=r"--num-experts 4 with --tensor-model-parallel-size 2 "
                                         r"needs --sequence-parallel.*add --sequence-parallel$"):
        validate(MOE + ["--tensor-model-parallel-size", 2], 2)


def test_expert_flags_without_experts_are_refused():
    with pytest.raises(ValueError, match=r"--expert-model-parallel-size need --num-experts"):
        validate(["--expert-model-parallel-size", 2], 2)


@pytest.mark.parametrize("flags, named", [
    (["--context-parallel-size", 2], "--context-parallel-size 2"),
    (["--dense-twin"], "--dense-twin")])
def test_what_the_trainer_does_not_do_with_experts_yet_is_refused(flags, named):
    with pytest.raises(ValueError, match=rf"--num-experts 4 with {named}: not supported"):
        validate(MOE + flags, 2)


def test_train_gpt_precheck_refuses_before_torchrun():
    with pytest.raises(ValueError, match=r"--num-experts 4 is not divisible by "
                                         r"--expert-model-parallel-size 3"):
        precheck(TRAIN_GPT, ["--num-experts", "4", "--expert-model-parallel-size", "3"], 3)
    with pytest.raises(ValueError, match=r"--moe-token-dispatcher-type: invalid choice"):
        precheck(TRAIN_GPT, ["--num-experts", "4", "--moe-token-dispatcher-type", "flex"], 1)
