"""A configuration that cannot work is refused in flag names, and every value a refusal suggests
works (mpu_lab.training.flag_errors, training.validate_args): each suggestion is followed here
by editing the command line itself and parsing it again, so a suggestion that led to a second
error would fail. Then the script-side refusal in-process: one message on rank 0, exit status
2, and under plain python the torchrun line to use (tests/launcher/test_refusal_under_torchrun.py
runs it under torchrun)."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mpu_lab import training
from mpu_lab.core.transformer.transformer_config import TransformerConfig
from mpu_lab.training import arguments, flag_errors
from mpu_lab.training.flag_errors import NPROC, FlagError
from mpu_lab.training.rank_groups_args import check_rank_groups_args, parse_and_check_args

T, P = "--tensor-model-parallel-size", "--pipeline-model-parallel-size"
CP = "--context-parallel-size"
NLV = "--num-layers-per-virtual-pipeline-stage"
MOE = ["--num-experts", 4, "--moe-router-topk", 2]
# (flags, ranks): configurations refused with suggestions
REFUSED = [
    ([T, 3], 4), ([T, 3], 8), ([T, 2, P, 3], 8), ([T, 2, P, 2], 6), ([T, 8], 8),
    ([T, 4, "--num-attention-heads", 6, "--hidden-size", 96], 4), (["--num-attention-heads", 5], 1),
    ([T, 8, "--num-attention-heads", 8, "--ffn-hidden-size", 100], 8),
    ([P, 4, "--num-layers", 6], 4), ([P, 2, "--num-layers", 4, NLV, 3], 2),
    ([P, 2, "--num-layers", 4, NLV, 1], 2),
    ([P, 2, "--num-layers", 4, "--pipeline-schedule", "gpipe", NLV, 1], 2),
    ([P, 2, "--num-layers", 4, "--pipeline-schedule", "interleaved"], 2),
    (["--micro-batch-size", 3, "--global-batch-size", 16], 4),
    ([T, 4, "--sequence-parallel", "--seq-length", 30], 4),
    ([CP, 4], 6), ([CP, 3], 4), ([CP, 2, "--seq-length", 30], 2),
    ([CP, 4, T, 4, "--sequence-parallel", "--seq-length", 40], 16),
    ([CP, 2, T, 2, "--cp-comm-type", "a2a", "--num-attention-heads", 6, "--hidden-size", 48], 4),
    ([CP, 2, "--attention-dropout", 0.1], 2),
    (["--num-experts", 3, "--expert-model-parallel-size", 2], 4),
    (["--num-experts", 6, "--expert-model-parallel-size", 4], 8),
    (MOE + ["--expert-model-parallel-size", 4], 6),
    (MOE + ["--expert-model-parallel-size", 2, P, 2, "--expert-tensor-parallel-size", 2,
            "--num-layers", 4], 4),
    (["--num-experts", 4, "--moe-router-topk", 5], 1),
    (["--num-experts", 4, "--moe-router-topk", 1], 1),
    (MOE + [T, 2], 2),
]


def validate(flags, world_size):
    return training.validate_args(training.parse_args([str(f) for f in flags]), world_size)


def followed(flags, flag, value):
    """The command line with one suggestion followed, edited as a person would edit it."""
    out, i = [], 0
    while i < len(flags):
        if flags[i] == flag:      # drop the flag and its value (a switch has none)
            i += 2 if i + 1 < len(flags) and not str(flags[i + 1]).startswith("--") else 1
            continue
        out.append(flags[i])
        i += 1
    if value is True:
        return out + [flag]
    return out if value is None or value is False else out + [flag, value]


@pytest.mark.parametrize("flags,world", REFUSED, ids=[" ".join(map(str, f)) + f"@{w}"
                                                      for f, w in REFUSED])
def test_every_suggested_value_works_when_followed(flags, world):
    with pytest.raises(FlagError) as err:
        validate(flags, world)
    fixes = err.value.fixes
    assert fixes, f"no suggestion for {flags} on {world} ranks: {err.value}"
    for flag, values in fixes.items():
        for value in values:
            if flag == NPROC:
                validate(flags, value)
            else:
                validate(followed(flags, flag, value), world)


@pytest.mark.parametrize("flags,world", REFUSED, ids=[" ".join(map(str, f)) + f"@{w}"
                                                      for f, w in REFUSED])
def test_the_message_names_flags_not_config_fields(flags, world):
    with pytest.raises(ValueError) as err:
        validate(flags, world)
    message = str(err.value)
    fields = set(TransformerConfig.__dataclass_fields__) | {
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "num_microbatches",
        "expert_model_parallel_size", "expert_tensor_parallel_size", "world_size"}
    named = {w for w in re.findall(r"(?<![\w-])[a-z]+(?:_[a-z]+)+", message) if w in fields}
    assert not named, f"{sorted(named)} in {message!r}"
    assert message.count("--") >= 2, message


def test_three_tp_ranks_of_four_suggest_the_sizes_that_fit_and_no_rank_count_that_fails():
    # by hand: TP must divide 4 ranks and 4 heads -> 1, 2, 4; 3 or 6 ranks fit TP 3 but 4
    # heads do not split 3 ways, so no rank count is suggested
    with pytest.raises(FlagError) as err:
        validate([T, 3], 4)
    assert err.value.fixes == {T: [1, 2, 4]}
    assert str(err.value).startswith(f"{T} 3 does not fit 4 ranks: world size 4 is not "
                                     f"divisible by tensor x pipeline parallel size 3 x 1 = 3")


def test_a_refusal_with_no_working_value_says_so():
    err = FlagError("--a 3 is wrong", {"--a": [1, 2], NPROC: [6]}).keeping(lambda f, v: False)
    assert str(err) == "--a 3 is wrong; no value of --a alone fits the other flags as given"
    err = FlagError("x", {"--s": [True], "--n": [None], NPROC: [4, 8]}).keeping(lambda f, v: True)
    assert str(err) == ("x; valid with the other flags as given: add --s; or leave out --n; or "
                        "4 or 8 ranks (torchrun --nproc-per-node)")


def test_rank_groups_flags_are_refused_in_their_own_names_with_sizes_that_fit():
    with pytest.raises(FlagError) as err:
        check_rank_groups_args(["--tp", 3, "--pp", 1], 4)
    assert err.value.fixes == {"--tp": [1, 2, 4], NPROC: [3, 6]}
    assert str(err.value).startswith("--tp 3 does not fit 4 ranks")
    with pytest.raises(FlagError, match=r"--order tp-cp-dp-pp: order 'tp-cp-dp-pp' leaves out "
                                        r"'ep'.*valid with the other flags as given: --order "
                                        r"tp-cp-ep-dp-pp$"):
        check_rank_groups_args(["--tp", 2, "--pp", 1, "--ep", 2, "--order", "tp-cp-dp-pp"], 8)


# --------------------------------------------------------------------------- the script's side
@pytest.fixture
def launched(monkeypatch):
    """Environment of a torchrun rank (``launched(rank, world)``), or of plain python
    (``launched(None, None)``)."""
    def env(rank, world):
        for key, value in (("RANK", rank), ("WORLD_SIZE", world)):
            if value is None:
                monkeypatch.delenv(key, raising=False)
            else:
                monkeypatch.setenv(key, str(value))
    return env


def refused(capsys, call):
    with pytest.raises(SystemExit) as exc:
        call()
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_rank_0_prints_one_message_in_flag_names_and_exits_2(launched, capsys):
    launched(0, 4)
    code, out, err = refused(capsys, lambda: arguments.parse_and_validate_args([T, 3]))
    assert (code, out) == (2, "")
    assert err == (f"train_gpt.py: error: {T} 3 does not fit 4 ranks: world size 4 is not "
                   f"divisible by tensor x pipeline parallel size 3 x 1 = 3 (world = TP x CP x "
                   f"DP x PP); valid with the other flags as given: {T} 1, 2 or 4\n")


def test_an_extra_check_is_refused_the_same_way(launched, capsys):
    def no_fault(args):
        raise ValueError("--inject-fault x: unknown")
    launched(0, 2)
    assert refused(capsys, lambda: arguments.parse_and_validate_args(
        [], extra_checks=[no_fault])) == (2, "", "train_gpt.py: error: --inject-fault x: unknown\n")


def test_a_good_configuration_under_torchrun_returns_the_validated_flags(launched):
    launched(1, 4)
    args = arguments.parse_and_validate_args([T, 2])
    assert (args.data_parallel_size, args.world_size) == (2, 4)


def test_plain_python_says_to_launch_with_torchrun_and_how_many_ranks(launched, capsys):
    launched(None, None)
    code, out, err = refused(capsys, lambda: arguments.parse_and_validate_args([T, 2, P, 2,
                                                                               "--num-layers", 4]))
    assert code == 2 and "with 1 ranks" not in err
    assert err.splitlines() == [
        "train_gpt.py: error: RANK and WORLD_SIZE are not set: run it under torchrun (the flags "
        "check out for 4 ranks, the fewest they need):",
        f"  torchrun --standalone --nproc-per-node 4 launch/train_gpt.py {T} 2 {P} 2 "
        f"--num-layers 4"]


def test_plain_python_still_checks_the_flags_for_the_ranks_they_need(launched, capsys):
    launched(None, None)
    code, _, err = refused(capsys, lambda: arguments.parse_and_validate_args([T, 3]))
    lines = err.splitlines()
    assert code == 2 and len(lines) == 2
    assert lines[0].startswith(f"train_gpt.py: error: --num-attention-heads 4 is not divisible "
                               f"by {T} 3")
    assert "checked for 3 ranks" in lines[1] and "torchrun" in lines[1]


def test_an_argparse_error_shows_a_short_usage_not_every_flag(launched, capsys):
    launched(0, 4)
    code, out, err = refused(capsys, lambda: arguments.parse_and_validate_args(["--tp", 2]))
    assert code == 2 and err.splitlines() == [
        "usage: train_gpt.py [flags] (train_gpt.py --help lists them)",
        "train_gpt.py: error: unrecognized arguments: --tp 2"]
    code, _, err = refused(capsys, lambda: parse_and_check_args(["--tp", "x"]))
    assert code == 2 and err.splitlines()[-1] == \
        "rank_groups.py: error: argument --tp: invalid int value: 'x'"
    assert err.startswith("usage: rank_groups.py [-h] [--tp TP]")   # a short usage stays


def test_a_rank_other_than_0_refuses_in_silence_until_torchrun_stops_it(tmp_path):
    # rank 0 must not be stopped before it prints: the others wait for torchrun's SIGTERM
    # (sent once rank 0 has exited) and then exit 2 as well, without a word
    code = ("from mpu_lab.training import arguments\n"
            "print('parsing', flush=True)\n"
            "arguments.parse_and_validate_args(['--tensor-model-parallel-size', '3'])\n")
    env = dict(os.environ, RANK="1", WORLD_SIZE="4")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "parsing\n"
    time.sleep(1.5)
    assert proc.poll() is None, "rank 1 left before torchrun stopped it"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out, err) == (2, "", "")
