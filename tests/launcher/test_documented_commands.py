"""Every command a learner is shown runs on a fresh clone (issue 37).

The commands (tests/documented.py reads them from README.md and the docstrings of
``launch/*.py``) run as written, in a folder that looks like a fresh clone as far as
output paths go: an empty temporary working directory with ``launch`` linked to the
repository's ``launch/``, so ``runs/...``, ``--save``, ``--metrics-file``, figure and profile
outputs land there, in folders that do not exist yet and that the script has to create. Every
output path the command names must exist afterwards.

"At toy sizes": :data:`TOY` says, command by command, what is appended to the command (flags
the script already has; with argparse the last value of a flag wins) or how many ranks it gets
instead, and why. A command not in :data:`TOY` fails :func:`test_every_command_has_a_row`:
a new example gets a row, and a stale row is an error too. ``torchrun`` runs as ``python -m
torch.distributed.run`` and ``python`` as this interpreter (the same programs, in the
environment under test); a torchrun line's agent is forked from the fork server, as the
launcher starts every job's (``run_in``).
"""
import argparse
import importlib.util
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import pytest

from documented import (COMMANDS, REPO, commands_in, launch_docstring, readme_code,
                        script_and_flags)
from mpu_lab.launcher import LAUNCH_DIR, agent, prechecks

# flags whose value is a path the command writes (the folder must be created by the script)
OUTPUT_FLAGS = ("--metrics-file", "--save", "--out", "--json", "--markdown", "--profile-dir",
                "--breakdown-profile")
# torchrun's variables must not leak in from a test that set them
CLEAN_ENV = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                          "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
TIMEOUT_S = 300


class Toy(NamedTuple):
    """How a documented command runs here: ``append`` goes after it; ``nproc`` replaces its
    ``--nproc-per-node``; ``outputs`` are paths it writes by default (besides those its
    :data:`OUTPUT_FLAGS` name); ``skip`` is a reason not to run it here at all (another
    command here runs the same code), and ``parse`` the script's argument parser that its
    flags and ``VAR=value`` settings, as written, must then pass (returning ``expect`` where
    given, worked from the docstring). ``run_by`` names the test file that runs the command
    as written, taken from tests/documented.py, for checks of its own: it does not run twice."""
    why: str
    append: Tuple[str, ...] = ()
    nproc: Optional[int] = None
    outputs: Tuple[str, ...] = ()
    skip: Optional[str] = None
    parse: Optional[str] = None
    expect: object = None
    run_by: Optional[str] = None


AS_WRITTEN = "as written: small already"
COST_SAME = ("a minute even at toy size, and at toy size (its --configs, sizes and --iters "
             "overridden) the same run as bench_cost_model.py:3 without --published")
TINY_GPT = ("--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "16", "--micro-batch-size", "2")
TINY_VS_PLAIN = TINY_GPT + ("--vocab-size", "64", "--rounds", "2", "--steps", "1",
                            "--warmup", "1")
TINY_COST = TINY_GPT + ("--configs", "dp2", "--iters", "6", "--tries", "1")
TINY_UTIL = ("--nproc", "2", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-length",
             "16", "--global-batch", "4", "--microbatches", "2", "--steps", "2")
TRAIN_2 = ("--train-iters", "2", "--log-interval", "1")
# the flags as written are checked for the ranks the command shows by
# test_the_flags_as_written_pass_the_scripts_precheck (the scripts with a PRECHECK)
FOUR_RANKS = "4 of its 8 ranks (its flags as written are pre-checked for 8)"

# where: what changes, and why. Keep a row per documented command (checked below).
TOY: Dict[str, Toy] = {
    "README:1": Toy("as written: Megatron's test layouts (tp=4 x pp=2, tp=2 x pp=4) need 8 "
                    "ranks; same as collectives.py:1"),
    "README:2": Toy("2 of its 50 iterations, each logged (the metrics file must be written)",
                    TRAIN_2),
    "activation_memory.py:1": Toy(AS_WRITTEN),
    "bench_bandwidth.py:1": Toy("4 KiB..64 KiB, 2 timed calls per size, 2 ranks: sizes, "
                                "counts and world are the benchmark's, any of them runs",
                                ("--max-bytes", "64K", "--iters", "2", "--warmup", "1"), nproc=2),
    "bench_bandwidth.py:2": Toy("1 MiB only (its 1 GiB rows take minutes on gloo), 2 timed "
                                "calls, 2 ranks: any world size runs it",
                                ("--max-bytes", "1M", "--iters", "2", "--warmup", "1"), nproc=2),
    "bench_cost_model.py:1": Toy("not run; its flags parse", skip=COST_SAME, parse="parse_args"),
    "bench_cost_model.py:2": Toy("not run; its flags parse", skip=COST_SAME, parse="parse_args"),
    "bench_cost_model.py:3": Toy("one configuration (dp2) of a one-layer width-32 GPT, 6 "
                                 "iterations (4 warm-up), one try: a configuration is 4 "
                                 "torchrun jobs, about a minute even so", TINY_COST),
    "bench_cost_model.py:4": Toy(AS_WRITTEN + " (one calibration job)"),
    "bench_gpt_vs_plain.py:1": Toy("a one-layer width-32 GPT, 2 rounds of 1 step: a minute "
                                   "and more at its CPU preset", TINY_VS_PLAIN),
    "bench_gpt_vs_plain.py:2": Toy("the GPU preset (GPT-2 small) with every size overridden, "
                                   "on the CPU: checks the preset path, not the figures",
                                   TINY_VS_PLAIN),
    "bench_gpt_vs_plain.py:3": Toy("as bench_gpt_vs_plain.py:1, under torchrun",
                                   TINY_VS_PLAIN),
    "bench_startup.py:1": Toy("one world of 2 ranks, once: 2, 4 and 8 ranks twice take a "
                              "minute", ("--ranks", "2", "--repeats", "1")),
    "bench_startup.py:2": Toy("not run; its flags parse", parse="parse_args",
                              expect=argparse.Namespace(ranks=[2, 4], repeats=2),
                              skip="bench_startup.py:1 runs the same driver at toy size (one "
                                   "world of 2 ranks) and bench_startup.py:3 a 4-rank job"),
    "bench_startup.py:3": Toy("2 ranks: any world size runs it", nproc=2),
    "capstone.py:1": Toy("as written (its --code resolved from the repository), with the "
                         "lines the capstone prints checked",
                         run_by="tests/labkit/capstone/test_capstone_mp.py"),
    "collectives.py:2": Toy("not run; its switches select two of the seven tests",
                            parse="selected_tests", expect=["broadcast", "copy"],
                            skip="README:1 runs all seven tests of collectives.py (--test all), "
                                 "these two among them, on the same 8 ranks"),
    "dp_overlap.py:1": Toy("1 timed step of a one-layer width-32 GPT at DP = 2 (its flags as "
                           "written are pre-checked for 4 ranks)",
                           ("--steps", "1", "--num-layers", "1", "--hidden-size", "32",
                            "--seq-length", "32"), nproc=2),
    "inspect_gpt.py:1": Toy(AS_WRITTEN),
    "linear_options.py:1": Toy(AS_WRITTEN),
    "linear_options.py:2": Toy(AS_WRITTEN),
    "linear_overlap.py:1": Toy("2 steps at sequence 64, width 64",
                               ("--seq", "64", "--hidden", "64", "--steps", "2")),
    "megatron_core_ddp.py:1": Toy("as written, every mode's values checked against mpu_lab's "
                                  "and a one-process AdamW (where megatron-core is installed)",
                                  run_by="tests/megatron_reference/test_megatron_ddp.py"),
    "megatron_core_moe.py:1": Toy("its cases on its 4 ranks and the eight others that run "
                                  "there, every output checked against Megatron-core's MoE "
                                  "layer (where megatron-core is installed)",
                                  run_by="tests/megatron_reference/test_megatron_moe.py"),
    "megatron_core_schedules.py:1": Toy("its cases on its 2 ranks and one case more, every "
                                        "stage's gradients checked against Megatron-core's "
                                        "schedules and the one-process twin (where "
                                        "megatron-core is installed)",
                                        run_by="tests/megatron_reference/"
                                               "test_megatron_schedules.py"),
    "megatron_core_side_by_side.py:1": Toy("on its 4 ranks with --tp 2 --sequence-parallel "
                                           "after it, every layer's and mapping's values "
                                           "checked against Megatron-core's (where "
                                           "megatron-core is installed)",
                                           run_by="tests/megatron_reference/"
                                                  "test_megatron_layers.py"),
    "memory_breakdown.py:1": Toy("its configurations and optimizers on its 4 ranks (the "
                                 "model's flags spelled out, a global batch of 8), every term "
                                 "checked against counts worked by hand",
                                 run_by="tests/perf/test_memory_accounting.py"),
    "parallel_linear.py:1": Toy(AS_WRITTEN),
    "pipeline_bubble.py:1": Toy("1 timed iteration per micro-batch count",
                                ("--iterations", "1")),
    "rank_groups.py:1": Toy("TP 2 x PP 2 on " + FOUR_RANKS + "; lab 01 prints the 8-rank "
                            "groups of the example (DP 2)", nproc=4),
    "rank_groups.py:2": Toy("not run; its flags pass the pre-check for its 8 ranks",
                            skip="rank_groups.py:1 runs the script; the expert groups of --ep "
                                 "are the 8-rank job's (tests/test_parallel_state_mp.py) and "
                                 "lab 13's"),
    "train_gpt.py:1": Toy("2 of its 300 iterations (its --metrics-file and --save must be "
                          "written), TP 2 x DP 1 on 2 of its 4 ranks (pre-checked for 4)",
                          TRAIN_2, nproc=2),
    "train_gpt.py:2": Toy("2 iterations; " + FOUR_RANKS + " (DP 1)", TRAIN_2, nproc=4),
    "train_gpt.py:3": Toy("not run; its flags pass the pre-check for its 8 ranks",
                          skip="at toy size (4 ranks, DP 1) the layout README:2 runs: TP 2 x "
                               "CP 2, p2p"),
    "train_gpt.py:4": Toy("2 iterations", TRAIN_2),
    "train_gpt.py:5": Toy("2 iterations", TRAIN_2),
    "zero_bubble_timing.py:1": Toy("1 timed iteration of each schedule, width 32, 4 "
                                   "micro-batches", ("--iterations", "1", "--hidden-size", "32",
                                                     "--microbatches", "4")),
    "utilisation.py:1": Toy("not run; its flags parse", parse="parse_args",
                            skip="at toy size the three jobs of utilisation.py:2 in fp32 and "
                                 "writing runs/utilisation: utilisation.py:2 runs the driver "
                                 "(bf16, --out) and lab 15 its fp32 runs"),
    "utilisation.py:2": Toy("2 ranks (the CPU default on 2 cores), a two-layer width-32 GPT, "
                            "2 steps per run: its bf16 and its --out folder on the CPU",
                            TINY_UTIL),
}


def as_run(command: str, toy: Toy) -> Tuple[List[str], Dict[str, str]]:
    """The argv and environment ``command`` runs with here, after ``toy``'s changes."""
    words, env = shlex.split(command), dict(CLEAN_ENV)
    while re.fullmatch(r"[A-Z][A-Z0-9_]*=\S*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if toy.nproc is not None:
        words[words.index("--nproc-per-node") + 1] = str(toy.nproc)
    program = {"torchrun": [sys.executable, "-m", "torch.distributed.run"],
               "python": [sys.executable], "python3": [sys.executable]}[words[0]]
    return program + words[1:] + list(toy.append), env


def output_paths(argv: Sequence[str], toy: Toy) -> List[str]:
    """The paths a run of ``argv`` writes: the last value of each output flag, and the
    defaults ``toy`` names."""
    named = {}
    for flag, value in zip(argv, argv[1:]):
        if flag in OUTPUT_FLAGS:
            named[flag] = value
    return [*named.values(), *toy.outputs]


def fresh_clone(folder: pathlib.Path) -> pathlib.Path:
    """An empty working directory with ``launch/`` linked in: no runs/, no checkpoints/."""
    (folder / "launch").symlink_to(LAUNCH_DIR, target_is_directory=True)
    return folder


def run_in(argv: Sequence[str], env: Dict[str, str], cwd: pathlib.Path):
    """Run ``argv`` in its own session, as ``launcher.run`` starts a job (a torchrun line:
    torch's torchrun ``main`` with these arguments, forked from the fork server that has torch
    loaded, :mod:`mpu_lab.launcher.agent`; a ``python`` line as a program); on timeout kill
    that whole session (torchrun and its ranks), so nothing outlives the test."""
    proc = agent.start(argv, env, cwd)
    out: List[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        reader.join(timeout=30)
        pytest.fail(f"{' '.join(argv)} ran past {TIMEOUT_S} s:\n{''.join(out)[-3000:]}")
    reader.join()
    return code, "".join(out)


def test_every_command_has_a_row():
    assert len(COMMANDS) >= 30
    assert sorted(COMMANDS) == sorted(TOY), (
        f"documented commands without a row in TOY: {sorted(set(COMMANDS) - set(TOY))}; "
        f"rows for no command: {sorted(set(TOY) - set(COMMANDS))}")


def test_every_launch_script_shows_its_command_line():
    for path in sorted(LAUNCH_DIR.glob("*.py")):
        commands = commands_in(launch_docstring(path))
        assert commands, f"launch/{path.name}: no command line in its docstring"
        assert all(f"launch/{path.name}" in c for c in commands), (path.name, commands)


def test_the_readme_shows_a_torchrun_command():
    readme = commands_in(readme_code((REPO / "README.md").read_text()))
    assert any(c.startswith("torchrun ") and "launch/train_gpt.py" in c for c in readme)


def test_a_reduction_keeps_the_command_and_only_appends():
    argv, env = as_run("TEST_COPY=1 torchrun --standalone --nproc-per-node 8 "
                       "launch/collectives.py --test all", Toy("", ("--x", "1"), nproc=2))
    assert argv == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", "launch/collectives.py", "--test", "all", "--x", "1"]
    assert env["TEST_COPY"] == "1" and "RANK" not in env
    assert output_paths(["--out", "a", "--save", "b", "--out", "c"], Toy("")) == ["c", "b"]


@pytest.mark.parametrize("where", sorted(w for w, c in COMMANDS.items() if c.split()[0] != "python"
                                         and prechecks.precheck_spec(
                                             LAUNCH_DIR / script_and_flags(c)[0])))
def test_the_flags_as_written_pass_the_scripts_precheck(where, tmp_path):
    """The launcher's pre-check of the script (pure, no process) accepts the command's flags
    for the number of ranks it shows, also where the run below uses fewer."""
    script, flags, nproc = script_and_flags(COMMANDS[where])
    prechecks.precheck(LAUNCH_DIR / script, flags, nproc, cwd=tmp_path)


@pytest.mark.parametrize("where", sorted(w for w in COMMANDS if w in TOY and TOY[w].parse))
def test_a_command_not_run_parses_as_written(where, monkeypatch):
    script, flags, _ = script_and_flags(COMMANDS[where])
    _, env = as_run(COMMANDS[where], TOY[where])
    for key in set(env) - set(CLEAN_ENV):                 # its VAR=value settings
        monkeypatch.setenv(key, env[key])
    spec = importlib.util.spec_from_file_location(f"_doc_{script[:-3]}", LAUNCH_DIR / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = getattr(module, TOY[where].parse)(flags)
    assert args is not None
    if TOY[where].expect is not None:
        assert args == TOY[where].expect


RUN_ELSEWHERE = sorted(w for w in COMMANDS if w in TOY and TOY[w].run_by)


@pytest.mark.parametrize("where", RUN_ELSEWHERE)
def test_a_command_run_by_another_test_is_taken_from_here_there(where):
    """The test file a row names reads the command from tests/documented.py, so it runs what
    the README or the docstring shows, whatever that becomes."""
    source = (REPO / TOY[where].run_by).read_text()
    assert f'COMMANDS["{where}"]' in source, (
        f"{TOY[where].run_by} does not take {where} from tests/documented.py")


@pytest.mark.slow
@pytest.mark.parametrize("where", sorted(set(COMMANDS) - set(RUN_ELSEWHERE)))
def test_the_documented_command_runs_on_a_fresh_clone(where, tmp_path):
    if where not in TOY:
        pytest.fail(f"{where}: no row in TOY for {COMMANDS[where]!r}")
    toy = TOY[where]
    if toy.skip:
        pytest.skip(toy.skip)
    cwd = fresh_clone(tmp_path)
    argv, env = as_run(COMMANDS[where], toy)
    env["TMPDIR"] = str(tmp_path)   # torchrun's own torchelastic_* log folders go with the test's
    outputs = output_paths(argv, toy)
    assert not any((cwd / p).exists() for p in outputs)
    start = time.monotonic()
    code, out = run_in(argv, env, cwd)
    took = time.monotonic() - start
    assert code == 0, f"{where}: {COMMANDS[where]}\nexit {code} after {took:.0f} s:\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    missing = [p for p in outputs if not (cwd / p).exists()]
    assert not missing, f"{where} did not write {missing}:\n{out[-2000:]}"
