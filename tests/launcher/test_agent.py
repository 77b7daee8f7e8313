"""mpu_lab.launcher.agent: torchrun's agent forked from a server that imported it, checked
against ``python -m torch.distributed.run`` started as a program (the second method), and the
rule for when it is not used (a script run by its path, whose top level a fork would rerun)."""
import os
import subprocess
import sys
import types

import pytest

from mpu_lab.launcher import agent

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
needs_fork_server = pytest.mark.skipif(
    agent.fork_server() is None or not agent.main_imports_safely(),
    reason="no fork server here, or this process's __main__ is a script run by its path")


def as_program(args):
    proc = subprocess.run(TORCHRUN + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120)
    return proc.returncode, proc.stdout


def forked(args):
    proc = agent.start(TORCHRUN + args, env=dict(os.environ))
    assert isinstance(proc, agent.AgentProcess)
    out = proc.stdout.read()
    return proc.wait(timeout=60), out


@needs_fork_server
@pytest.mark.parametrize("args", [["--help"], ["--nproc-per-node", "2", "--no-such-flag", "x.py"]],
                         ids=["help", "bad-flag"])
def test_the_forked_agent_answers_as_torchrun_the_program(args):
    code, out = forked(args)
    assert (code, out) == as_program(args)
    assert code == (0 if args == ["--help"] else 2)
    assert "--nproc-per-node" in out


def test_another_command_runs_as_a_program():
    proc = agent.start([sys.executable, "-c", "print('hi')"], env={})
    assert isinstance(proc, subprocess.Popen)
    assert proc.stdout.read() == "hi\n" and proc.wait(timeout=30) == 0


@pytest.mark.parametrize("main,safe", [
    (dict(__spec__=None), True),                                     # a notebook kernel, -c
    (dict(__spec__=types.SimpleNamespace(name="pytest.__main__"), __file__="x.py"), True),  # -m
    (dict(__spec__=None, __file__="/home/me/train.py"), False),      # a script by its path
    (dict(__spec__=None, __file__="<stdin>"), False),                # python - < script
], ids=["kernel", "module", "script", "stdin"])
def test_a_fork_reimports_main_only_where_that_is_safe(monkeypatch, main, safe):
    module = types.ModuleType("__main__")
    for key, value in main.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, "__main__", module)
    assert agent.main_imports_safely() is safe
