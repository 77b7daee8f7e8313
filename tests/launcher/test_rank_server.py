"""mpu_lab.launcher.rank_server: ranks forked from a server that has torch loaded, checked
against the same job's ranks started by torchrun as ``python -u script.py``
(``MPU_LAB_FORK_RANKS=0``, the second method), and its rules on worked examples."""
import os
import pathlib
import signal

import pytest

from mpu_lab import launcher
from mpu_lab.launcher import agent, rank_server

PROBE = pathlib.Path(__file__).resolve().parent.parent / "mp" / "rank_state_probe.py"
needs_forked_ranks = pytest.mark.skipif(
    not rank_server.wanted(dict(os.environ)) or agent.fork_server() is None
    or not agent.main_imports_safely(),
    reason="ranks are not forked here (a GPU driver, no fork server, MPU_LAB_FORK_RANKS=0, "
           "or this process's __main__ is a script run by its path)")


def launch(fork: bool, **env):
    env["MPU_LAB_FORK_RANKS"] = "1" if fork else "0"
    return launcher.run(str(PROBE), nproc=2, show="none", env=env, timeout_s=120)


def failure(fork: bool, **env) -> launcher.LaunchError:
    with pytest.raises(launcher.LaunchError) as info:
        launch(fork, **env)
    return info.value


def forked_flags(results) -> list:
    """Pop each rank's command line: a forked rank keeps its server's, multiprocessing's fork
    server's; a rank started as a program has ``python -u script``."""
    return ["multiprocessing.forkserver" in state.pop("cmdline") for state in results]


def test_load_time_variables_that_differ_are_named_and_run_time_ones_are_not():
    load = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "TORCH_LOGS": "+dynamo", "PYTHONPATH": "a",
            "TORCHELASTIC_RUN_ID": "0", "LC_ALL": "C"}
    env = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "TORCH_LOGS": "+dynamo",
           "PYTHONPATH": "b", "TORCHELASTIC_RUN_ID": "7", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
           "RANK": "3", "PYTHONHASHSEED": "0"}
    assert rank_server.differs_at_load(load, env) == ["LC_ALL", "PYTHONHASHSEED",
                                                      "TORCH_DISTRIBUTED_DEBUG"]
    assert rank_server.differs_at_load(load, dict(load)) == []


@pytest.mark.parametrize("argv,forkable", [
    (["-u", __file__, "--flag"], True),
    (["-u", "-m", "json.tool"], True),
    (["-u", "no_such_script.py"], False),      # Python's own message, from Python
    (["-u", "-X", "dev", __file__], False),
    ([__file__], False),
    (["-u", "-m"], False),
], ids=["script", "module", "missing", "other-flags", "no-u", "no-module"])
def test_only_what_torchrun_starts_is_forked(argv, forkable):
    assert rank_server.forkable(argv, os.getcwd()) is forkable


def test_no_fork_where_switched_off_or_python_exec_is_set():
    assert not rank_server.wanted({"MPU_LAB_FORK_RANKS": "0"})
    assert not rank_server.wanted({"PYTHON_EXEC": "/usr/bin/python3"})


@needs_forked_ranks
def test_a_forked_rank_sees_what_a_rank_started_as_python_sees():
    forked, program = launch(True).results, launch(False).results
    assert forked_flags(forked) == [True, True]
    assert forked_flags(program) == [False, False]
    draws = [state.pop("random") for state in forked]
    assert draws[0] != draws[1]                # each rank its own seed, as a fresh interpreter
    for state in program:
        state.pop("random")
    assert forked == program
    assert forked[0]["name"] == "__main__" and forked[0]["server_vars"] == []
    assert forked[0]["threads"] == int(os.environ.get("OMP_NUM_THREADS") or
                                       max(1, (os.cpu_count() or 1) // 2))


@needs_forked_ranks
def test_a_variable_read_while_loading_starts_the_ranks_as_programs():
    assert forked_flags(launch(True, TORCH_CPP_LOG_LEVEL="ERROR").results) == [False, False]


@needs_forked_ranks
def test_a_rank_that_raises_fails_as_a_program_would():
    forked, program = failure(True, RAISE="1"), failure(False, RAISE="1")
    assert (forked.rank, forked.returncode) == (program.rank, program.returncode)
    assert forked.traceback == program.traceback
    assert forked.traceback.splitlines()[1].startswith(f'  File "{PROBE}"')
    for error in (forked, program):
        text = [line for _, line in error.output]
        assert any("atexit ran" in line for line in text)
        assert any("thread joined" in line for line in text)


@needs_forked_ranks
def test_a_rank_killed_by_a_signal_is_reported_as_a_program_would_be():
    kill = str(int(signal.SIGKILL))
    forked, program = failure(True, KILL_SELF=kill), failure(False, KILL_SELF=kill)
    assert str(forked) == str(program)
    assert "rank 0 was killed by signal 9" in str(forked)


@needs_forked_ranks
@pytest.mark.parametrize("env", [{"EXIT": "-1"}, {"EXIT": "3"}, {"INTERRUPT": "1"}],
                         ids=["exit-minus-1", "exit-3", "keyboard-interrupt"])
def test_a_rank_that_exits_early_is_reported_as_a_program_would_be(env):
    forked, program = failure(True, **env), failure(False, **env)
    assert str(forked) == str(program)
    assert forked.traceback == program.traceback


@needs_forked_ranks
def test_torchruns_sigterm_reaches_the_rank_through_its_client():
    forked, program = failure(True, AWAIT_SIGTERM="1"), failure(False, AWAIT_SIGTERM="1")
    for error in (forked, program):
        assert (1, "rank 1 got SIGTERM") in [(r, line.strip()) for r, line in error.output]
    assert str(forked) == str(program)
