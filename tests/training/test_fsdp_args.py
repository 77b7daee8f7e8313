"""launch/train_gpt.py's Megatron-FSDP flags (mpu_lab.training.fsdp_args) refused before any
process starts (pure: no job, no torch.distributed), each message naming the flags, their
values and what would be valid; and the launcher's pre-check refusing the same."""
import pytest

from mpu_lab import training
from mpu_lab.launcher import LAUNCH_DIR
from mpu_lab.launcher.prechecks import precheck
from mpu_lab.training.fsdp_args import sharding_strategy

TRAIN_GPT = LAUNCH_DIR / "train_gpt.py"
S = "--data-parallel-sharding-strategy"


def validate(flags, world_size=4):
    return training.validate_args(training.parse_args([str(f) for f in flags]), world_size)


@pytest.mark.parametrize("flags, strategy", [
    ([], None), (["--use-megatron-fsdp"], "no_shard"),
    (["--use-megatron-fsdp", S, "optim_grads_params"], "optim_grads_params"),
    (["--use-megatron-fsdp", S, "optim_grads", "--tensor-model-parallel-size", 2], "optim_grads")])
def test_the_strategy_a_run_uses(flags, strategy):
    assert sharding_strategy(validate(flags)) == strategy


@pytest.mark.parametrize("flags, message", [
    ([S, "optim"], rf"^{S} optim shards through Megatron-FSDP, which is off; valid with the "
                   rf"other flags as given: add --use-megatron-fsdp; or leave out {S}$"),
    (["--use-megatron-fsdp", S, "optim", "--use-distributed-optimizer"],
     r"with --use-distributed-optimizer: Megatron-FSDP shards the optimizer states itself "
     rf"\({S} optim is the distributed optimizer\); valid with the other flags as given: "
     r"leave out --use-distributed-optimizer$"),     # leaving out --use-megatron-fsdp: S alone
    (["--use-megatron-fsdp", "--pipeline-model-parallel-size", 2],
     r"^--use-megatron-fsdp with --pipeline-model-parallel-size 2: .* one pipeline stage; "
     r"valid .*: --pipeline-model-parallel-size 1; or leave out --use-megatron-fsdp$"),
    (["--use-megatron-fsdp", "--num-experts", 4],
     r"^--use-megatron-fsdp with --num-experts 4: .*dense models only; valid .*: leave out "
     r"--num-experts; or leave out --use-megatron-fsdp$"),
    (["--use-megatron-fsdp", S, "optim_grads_params", "--tensor-model-parallel-size", 2,
      "--sequence-parallel"],
     rf"^{S} optim_grads_params with --sequence-parallel: .*; valid .*: leave out "
     rf"--sequence-parallel; or {S} no_shard or optim$"),
    (["--use-megatron-fsdp", S, "optim_grads_params", "--dense-twin"],
     rf"^{S} optim_grads_params with --dense-twin: .*; valid .*: leave out --dense-twin; or "
     rf"{S} no_shard, optim or optim_grads$"),
])
def test_bad_combinations_are_refused_with_what_would_be_valid(flags, message):
    with pytest.raises(ValueError, match=message):
        validate(flags)


def test_an_unknown_strategy_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        training.parse_args(["--use-megatron-fsdp", S, "zero3"])


def test_the_launcher_refuses_before_torchrun_starts():
    with pytest.raises(ValueError, match=rf"{S} optim_grads shards through Megatron-FSDP"):
        precheck(TRAIN_GPT, [S, "optim_grads"], 4)
