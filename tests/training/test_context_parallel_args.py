"""--context-parallel-size and --cp-comm-type refused before any process starts (pure: no job,
no torch.distributed): launch/train_gpt.py's pre-check and training.validate_args name the
numbers and what would be valid; the model's own refusals in a one-rank world."""
import pytest

from mpu_lab import training
from mpu_lab.launcher import LAUNCH_DIR, run
from mpu_lab.launcher.prechecks import precheck
from mpu_lab.core.transformer import TransformerConfig
from mpu_lab.core.transformer.attention import SelfAttention

TRAIN_GPT = LAUNCH_DIR / "train_gpt.py"


def validate(flags, world_size):
    return training.validate_args(training.parse_args(flags), world_size)


def test_valid_layouts_give_dp_as_world_over_tp_cp_pp():
    assert validate(["--context-parallel-size", 2], 8).data_parallel_size == 4
    assert validate(["--context-parallel-size", 2, "--tensor-model-parallel-size", 2,
                     "--pipeline-model-parallel-size", 2, "--num-layers", 4], 8
                    ).data_parallel_size == 1
    args = validate(["--context-parallel-size", 4, "--cp-comm-type", "a2a"], 4)
    cfg = training.model_config(args)
    assert (cfg.context_parallel_size, cfg.cp_comm_type) == (4, "a2a")


def test_sequence_length_not_divisible_by_2cp_is_refused_with_the_nearest_lengths():
    with pytest.raises(ValueError, match=r"--seq-length 30 is not divisible by 2 x "
                                         r"--context-parallel-size = 2 x 2 = 4.*valid with the "
                                         r"other flags as given: --seq-length 28 or 32$"):
        validate(["--context-parallel-size", 2, "--seq-length", 30], 2)


def test_a2a_needs_heads_divisible_by_tp_times_cp():
    # 4 heads at TP=2 x CP=2 split into whole heads; 6 heads do not
    validate(["--context-parallel-size", 2, "--tensor-model-parallel-size", 2,
              "--cp-comm-type", "a2a"], 4)
    with pytest.raises(ValueError, match=r"TP x CP = 2 x 2 = 4 .*--num-attention-heads 6 is not "
                                         r"divisible by 4.*--num-attention-heads 4 or 8; "
                                         r"or --cp-comm-type p2p or allgather$"):
        validate(["--context-parallel-size", 2, "--tensor-model-parallel-size", 2,
                  "--cp-comm-type", "a2a", "--num-attention-heads", 6, "--hidden-size", 48], 4)
    # the other comm types take any head count
    validate(["--context-parallel-size", 2, "--tensor-model-parallel-size", 2,
              "--num-attention-heads", 6, "--hidden-size", 48], 4)


def test_cp_not_dividing_the_world_names_the_valid_sizes():
    # CP 3 and 6 divide the 6 ranks but not the 64 positions into 2 x cp chunks: not suggested
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tensor x context x "
                                         r"pipeline parallel size 1 x 4 x 1 = 4.*valid with the "
                                         r"other flags as given: --context-parallel-size 1 or 2; "
                                         r"or 4 or 8 ranks \(torchrun --nproc-per-node\)$"):
        validate(["--context-parallel-size", 4], 6)
    with pytest.raises(ValueError, match=r"2 x 3 x 2 = 12 .*: --context-parallel-size 1 or 2; "
                                         r"or 12 ranks"):
        validate(["--context-parallel-size", 3, "--tensor-model-parallel-size", 2,
                  "--pipeline-model-parallel-size", 2, "--num-layers", 4,
                  "--seq-length", 48], 8)


def test_sequence_parallel_needs_each_cp_ranks_tokens_divisible_by_tp():
    with pytest.raises(ValueError, match=r"s/cp = 40 / 4 = 10 tokens.*TP = 4.*multiple of "
                                         r"2 x CP x TP = 32.*--seq-length 32 or 64; or "
                                         r"--tensor-model-parallel-size 1 or 2$"):
        validate(["--context-parallel-size", 4, "--tensor-model-parallel-size", 4,
                  "--sequence-parallel", "--seq-length", 40], 16)


def test_attention_dropout_is_refused_with_cp():
    with pytest.raises(ValueError, match=r"--attention-dropout 0.1 with --context-parallel-size 2"):
        validate(["--context-parallel-size", 2, "--attention-dropout", 0.1], 2)


def test_train_gpt_precheck_refuses_an_unknown_comm_type_with_argparses_choices():
    with pytest.raises(ValueError, match=r"--cp-comm-type: invalid choice: 'ring'.*"
                                         r"'p2p', 'a2a', 'allgather'"):
        precheck(TRAIN_GPT, ["--context-parallel-size", "2", "--cp-comm-type", "ring"], 2)


def test_the_launcher_refuses_before_torchrun_starts():
    # run() calls the script's PRECHECK first: no process is started for these
    for flags, nproc, message in [
            (["--context-parallel-size", "2", "--seq-length", "30"], 2, "2 x 2 = 4"),
            (["--context-parallel-size", "3"], 4, "--context-parallel-size 1, 2 or 4$"),
            (["--context-parallel-size", "4", "--cp-comm-type", "a2a",
              "--num-attention-heads", "2", "--hidden-size", "32"], 4, "not divisible by 4")]:
        with pytest.raises(ValueError, match=message):
            run("train_gpt.py", flags, nproc=nproc, show="none")


@pytest.mark.usefixtures("world")   # a one-rank world (tests/conftest.py)
def test_the_model_refuses_attention_dropout_and_a_cp_size_its_groups_lack():
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4)
    with pytest.raises(ValueError, match="attention_dropout 0.1 with context_parallel_size 2"):
        SelfAttention(TransformerConfig(**base, context_parallel_size=2, attention_dropout=0.1))
    with pytest.raises(ValueError, match="attention_impl 'explicit'"):
        SelfAttention(TransformerConfig(**base, context_parallel_size=2, attention_impl="explicit"))
    with pytest.raises(ValueError, match="context_parallel_size is 2 but the CP group size of "
                                         "parallel_state is 1"):
        SelfAttention(TransformerConfig(**base, context_parallel_size=2))
