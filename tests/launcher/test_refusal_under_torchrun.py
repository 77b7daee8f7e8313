"""A configuration that cannot work, started by hand (issue 37): under ``torchrun
--nproc-per-node 4`` the script refuses it before any process group starts with one message,
printed by rank 0 alone, in flag names, and every rank exits with status 2 (torchrun's own
failure report comes on top: not ours to silence); under plain ``python`` it says to use
torchrun, with the line to run. Each rank's own output is read from torchrun's per-rank logs
(``--tee``), so torchrun's report is not counted as the script's."""
import os
import pathlib
import subprocess
import sys

import pytest

from mpu_lab.launcher import LAUNCH_DIR

T = "--tensor-model-parallel-size"
MAX_OWN_LINES = 5
# torchrun's environment variables must not leak in from a test that set them
CLEAN_ENV = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                          "MASTER_PORT", "TORCHELASTIC_RUN_ID")}


def torchrun(script: pathlib.Path, flags, nproc: int, folder: pathlib.Path):
    """Run ``script`` under torchrun; returns (torchrun's process, {rank: its own output})."""
    logs = folder / "logs"
    # torchrun looks at its ranks every --monitor-interval seconds (0.1 by default) and stops
    # the rest once one has failed: under load that can land before every rank has refused on
    # its own. Looking every 5 s lets each rank's own exit status be seen.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "--monitor-interval", "5", "--tee", "3", "--log-dir", str(logs),
           str(script), *map(str, flags)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=folder,
                          env=CLEAN_ENV)
    own = {int(d.name): (d / "stdout.log").read_text() + (d / "stderr.log").read_text()
           for d in logs.glob("*/attempt_*/*") if d.name.isdigit()}
    return proc, own


def assert_refused_once(proc, own, nproc: int, script: str) -> str:
    """One message, rank 0's, at most a few lines; the other ranks silent; every rank exit 2.
    Returns the message."""
    assert proc.returncode == 1, proc.stdout + proc.stderr       # torchrun's: a rank failed
    assert sorted(own) == list(range(nproc))
    lines = own[0].splitlines()
    assert 1 <= len(lines) <= MAX_OWN_LINES, own[0]
    assert lines[0].startswith(f"{script}: error: ") and "Traceback" not in own[0], own[0]
    assert {r: own[r] for r in own if r} == {r: "" for r in range(1, nproc)}
    console = proc.stdout + proc.stderr
    assert console.count(lines[0]) == 1, console               # shown once (--tee echoes it)
    assert console.count("exitcode  : 2") == nproc, console     # torchrun's report, per rank
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("script,flags,needles", [
    ("train_gpt.py", [T, 3],
     [f"{T} 3 does not fit 4 ranks", f"valid with the other flags as given: {T} 1, 2 or 4"]),
    ("train_gpt.py", ["--num-experts", 3, "--expert-model-parallel-size", 2],
     ["--num-experts 3 is not divisible by --expert-model-parallel-size 2",
      "valid with the other flags as given: --expert-model-parallel-size 1; or --num-experts "
      "2 or 4"]),
    ("rank_groups.py", ["--tp", 3, "--pp", 1],
     ["--tp 3 does not fit 4 ranks", "--tp 1, 2 or 4; or 3 or 6 ranks"]),
], ids=["train_gpt-tp3", "train_gpt-experts3-ep2", "rank_groups-tp3"])
def test_a_refused_configuration_prints_one_message_on_rank_0(script, flags, needles, tmp_path):
    proc, own = torchrun(LAUNCH_DIR / script, flags, 4, tmp_path)
    message = assert_refused_once(proc, own, 4, script)
    for needle in needles:
        assert needle in message, message
    assert "num_moe_experts" not in message and "with 1 ranks" not in message


@pytest.mark.parametrize("script,flags,command", [
    ("train_gpt.py", [T, 2],
     f"torchrun --standalone --nproc-per-node 2 launch/train_gpt.py {T} 2"),
    ("rank_groups.py", [], "torchrun --standalone --nproc-per-node 4 launch/rank_groups.py"),
])
def test_plain_python_says_to_run_under_torchrun_with_the_line_to_use(script, flags, command):
    proc = subprocess.run([sys.executable, f"launch/{script}", *map(str, flags)],
                          capture_output=True, text=True, timeout=120, env=CLEAN_ENV,
                          cwd=LAUNCH_DIR.parent)
    lines = proc.stderr.splitlines()
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert lines[0].startswith(f"{script}: error: RANK and WORLD_SIZE are not set: run it under "
                               f"torchrun") and "with 1 ranks" not in proc.stderr
    assert lines[1:] == [f"  {command}"]
