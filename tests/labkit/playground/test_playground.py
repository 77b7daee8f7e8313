"""The live playground: a 4-rank world of ipyparallel engines, reused by every test here.

The world is t = 2, p = 2, so Megatron's default order puts ranks {0, 1} and {2, 3} in the
tensor-parallel groups. Expected values are written out from that layout by hand (the groups
of consecutive ranks, tp at a time), not taken from the code under test.
"""
import os
import time

import ipyparallel
import psutil
import pytest

from mpu_lab import launcher
from mpu_lab.labkit import playground

pytestmark = pytest.mark.slow

WORLD, TP, PP = 4, 2, 2
TIMEOUT_S = 4.0


def tp_group(rank):
    """Megatron's default order (tp fastest): tensor-parallel groups are blocks of TP ranks."""
    start = rank // TP * TP
    return list(range(start, start + TP))


def _child_env():
    """This environment, with this checkout first on the path of a child interpreter."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(launcher.REPO_ROOT), os.environ.get("PYTHONPATH")) if p))


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def world():
    w = playground.start_world(WORLD, tensor_model_parallel_size=TP,
                               pipeline_model_parallel_size=PP, timeout_s=TIMEOUT_S)
    yield w
    w.stop()


def test_bad_arguments_raise_before_anything_starts(monkeypatch):
    def no_cluster(*args, **kwargs):
        raise AssertionError("a cluster was started for bad arguments")
    monkeypatch.setattr(ipyparallel, "Cluster", no_cluster)
    with pytest.raises(ValueError, match="world_size 6 is not divisible.*= 4"):
        playground.start_world(6, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    monkeypatch.setenv("MPU_LAB_MAX_RANKS", "2")
    with pytest.raises(ValueError, match="world_size 4 is more ranks than this machine starts .2"):
        playground.start_world(4)
    monkeypatch.delenv("MPU_LAB_MAX_RANKS")
    with pytest.raises(ValueError, match="backend must be 'auto', 'gloo' or 'nccl', got 'mpi'"):
        playground.start_world(2, backend="mpi")
    with pytest.raises(ValueError, match="timeout_s must be .* > 0, got 0"):
        playground.start_world(2, timeout_s=0)
    with pytest.raises(ValueError, match="start_timeout_s must be .* > 0, got -1"):
        playground.start_world(2, start_timeout_s=-1)


def test_each_engine_is_one_rank_with_torchrun_variables_and_megatron_groups(world):
    got = world.run("import os\n(rank, dist.get_world_size(), int(os.environ['LOCAL_RANK']),"
                    " parallel_state.get_tensor_model_parallel_rank(),"
                    " parallel_state.get_pipeline_model_parallel_rank())")
    # rank r: tp rank r % 2, pipeline stage r // 2 (tp x dp = 2 ranks per stage)
    assert got == [(r, WORLD, r, r % TP, r // (WORLD // PP)) for r in range(WORLD)]
    assert world.backend == "gloo" and len(set(world.pids)) == WORLD
    assert world.groups("tp") == [tp_group(0), tp_group(2)]


def test_copy_to_is_identity_forward_and_all_reduce_backward_megatron_numbers(world):
    # Megatron's copy-to test: backward of f on each rank's own number sums its TP group
    # (6 / 22 on 8 ranks at t = 4; on this 4-rank world at t = 2: 0+1 = 1 and 2+3 = 5).
    world.run("x = torch.full((3,), float(rank), requires_grad=True)\n"
              "y = copy_to_tensor_model_parallel_region(x)\n"
              "y.backward(torch.full((3,), float(rank)))")
    forward = world.values("y")
    grads = world.values("x.grad")
    assert forward == [[float(r)] * 3 for r in range(WORLD)]
    assert grads == [[float(sum(tp_group(r)))] * 3 for r in range(WORLD)]
    assert [g[0] for g in grads] == [1.0, 1.0, 5.0, 5.0]


def test_reduce_from_is_all_reduce_forward_and_identity_backward(world):
    world.run("x = (torch.arange(4.) * (rank + 1)).requires_grad_()\n"
              "y = reduce_from_tensor_model_parallel_region(x)\n"
              "y.backward(torch.ones(4) * (rank + 1))")
    for r, (y, grad) in enumerate(zip(world.values("y"), world.values("x.grad"))):
        factor = sum(q + 1 for q in tp_group(r))
        assert y == [i * factor for i in range(4)]
        assert grad == [float(r + 1)] * 4


def test_scatter_gather_and_the_sequence_parallel_trio_match_the_dense_tensor(world):
    world.run("full = torch.arange(24.).reshape(4, 6) + 100 * (rank // 2)\n"   # same within a group
              "cols = scatter_to_tensor_model_parallel_region(full)\n"
              "back = gather_from_tensor_model_parallel_region(cols)\n"
              "rows = scatter_to_sequence_parallel_region(full)\n"
              "seq = gather_from_sequence_parallel_region(rows)\n"
              "rs = reduce_scatter_to_sequence_parallel_region(torch.arange(8.).reshape(4, 2) * (rank + 1))")
    values = {name: world.values(name) for name in ("full", "cols", "back", "rows", "seq", "rs")}
    for r in range(WORLD):
        full, pos = values["full"][r], r % TP
        assert values["cols"][r] == [row[3 * pos:3 * pos + 3] for row in full]
        assert values["back"][r] == full
        assert values["rows"][r] == full[2 * pos:2 * pos + 2]
        assert values["seq"][r] == full
        factor = sum(q + 1 for q in tp_group(r))
        dense = [[float(2 * i + j) * factor for j in range(2)] for i in range(4)]
        assert values["rs"][r] == dense[2 * pos:2 * pos + 2]


@ipyparallel.interactive
def _tp_sum_of(value):
    """Pickled by value (interactive): runs in the engine's namespace."""
    t = torch.tensor([float(value)])  # noqa: F821 -- the engine namespace has torch, dist
    dist.all_reduce(t, group=parallel_state.get_tensor_model_parallel_group())  # noqa: F821
    print(f"rank {rank} sends {value}")  # noqa: F821
    return t.item()


def test_a_function_runs_on_every_rank_with_its_arguments(world):
    assert world.run(_tp_sum_of, 10) == [20.0, 20.0, 20.0, 20.0]
    outputs = world.execute(_tp_sum_of, 1, ranks=None)
    assert [o.stdout for o in outputs] == [f"rank {r} sends 1\n" for r in range(WORLD)]


def test_ranks_magic_prints_each_rank_under_its_heading_in_rank_order(world, capsys):
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    try:
        shell.run_line_magic("load_ext", "mpu_lab.labkit.playground")
        # rank 3 prints first, rank 0 last: the output must still be in rank order
        cell = "import time\ntime.sleep(0.2 * (3 - rank))\nprint('I am', rank)\nrank * 10"
        shell.run_cell_magic("ranks", "", cell)
        expected = "".join(f"--- rank {r} ---\nI am {r}\n{10 * r}\n" for r in range(WORLD))
        assert capsys.readouterr().out == expected
        shell.run_cell_magic("ranks", "1, 3", "print(rank)")
        assert capsys.readouterr().out == "--- rank 1 ---\n1\n--- rank 3 ---\n3\n"
        # a rank that raises fails the cell (Run All and papermill stop here), after every
        # rank's output is printed; --may-fail prints the same and carries on
        with pytest.raises(playground.RankError, match=r"ranks \[2\] raised.*--may-fail"):
            shell.run_cell_magic("ranks", "", "print(rank)\nassert rank != 2, 'no'")
        out = capsys.readouterr().out
        assert out.index("--- rank 0 ---\n0") < out.index("--- rank 2 --- raised AssertionError")
        assert "--- rank 3 ---\n3" in out
        shell.run_cell_magic("ranks", "--may-fail", "assert rank != 2, 'no'")
        assert "--- rank 2 --- raised AssertionError: no" in capsys.readouterr().out
        with pytest.raises(playground.PlaygroundError, match="are not rank numbers.*usage"):
            shell.run_cell_magic("ranks", "all", "rank")
    finally:
        # no IPython shell left behind: later tests in this process (viz.LiveLossPlot's
        # outside-a-notebook case) ask get_ipython() whether they run in one
        InteractiveShell.clear_instance()


def test_a_rank_that_raises_shows_its_traceback_and_the_world_stays_usable(world, capsys):
    with pytest.raises(playground.RankError) as info:
        world.run("print('before', rank)\nz = 1 / (rank - 1)\nrank")
    err = info.value
    assert sorted(err.failures) == [1] and not isinstance(err, playground.CollectiveTimeout)
    assert "--- rank 1 ---" in str(err) and "ZeroDivisionError" in str(err)
    assert 'File "<rank 1 cell>", line 2' in err.failures[1].traceback
    assert [(o.rank, o.value, o.stdout) for o in err.outputs if not o.error] == [
        (r, r, f"before {r}\n") for r in (0, 2, 3)]
    world.show("print('before', rank)\nz = 1 / (rank - 1)")
    out = capsys.readouterr().out
    assert out.index("--- rank 0 ---") < out.index("--- rank 1 --- raised ZeroDivisionError") \
        < out.index("--- rank 2 ---") < out.index("ranks [1] raised")
    assert world.run("x = torch.tensor([1.]); dist.all_reduce(x); x.item()") == [4.0] * WORLD


def test_a_restart_whose_new_ports_fail_tries_the_next_and_keeps_the_engines(world,
                                                                             monkeypatch):
    """A loaded machine can make a new group miss its timeout: the restart tries the next new
    port, up to RESTART_PORTS, and says why each failed; after that it replaces the engines."""
    world.run("kept = rank + 1")
    real, calls = world._init_group, []

    def failing_first(new_port=False):
        calls.append(new_port)
        if len(calls) < playground.RESTART_PORTS:
            raise RuntimeError(f"stand-in failure {len(calls)}")
        return real(new_port=new_port)

    monkeypatch.setattr(world, "_init_group", failing_first)
    pids = list(world.pids)
    world.restart()
    assert calls == [True] * playground.RESTART_PORTS
    assert world.restart_errors == [f"RuntimeError: stand-in failure {n}"
                                    for n in range(1, playground.RESTART_PORTS)]
    assert world.pids == pids and world.run("kept") == [1, 2, 3, 4]


def test_a_partial_collective_times_out_naming_the_missing_ranks_and_restart_recovers(world):
    world.run("kept = 7 * rank")
    with pytest.raises(playground.CollectiveTimeout) as info:
        world.run("x = torch.ones(1); dist.all_reduce(x)", ranks=[0, 1])
    assert info.value.waiting == [0, 1] and info.value.missing == [2, 3]
    assert "ranks [2, 3] did not arrive" in str(info.value)
    assert "ranks [2, 3] were not asked to run this cell" in str(info.value)
    with pytest.raises(playground.PlaygroundError, match="restart"):
        world.run("rank")
    pids = list(world.pids)
    world.restart()                  # the same engines (their state kept), a new group
    assert world.pids == pids, f"the engines were replaced: {world.restart_errors}"
    assert world.run("kept") == [0, 7, 14, 21]
    # ranks 2 and 3 finish the cell without entering the collective
    with pytest.raises(playground.CollectiveTimeout) as info:
        world.run("if rank < 2:\n    dist.all_reduce(torch.ones(1))")
    assert info.value.missing == [2, 3]
    assert "ranks [2, 3] finished it without entering the collective" in str(info.value)
    world.restart()
    # Megatron's groups time out as quickly as the world's (torch's default for a new group is
    # 30 minutes): rank 0 alone in its tensor-parallel group's all-reduce
    with pytest.raises(playground.CollectiveTimeout) as info:
        world.run("if rank == 0:\n    dist.all_reduce(torch.ones(1), "
                  "group=parallel_state.get_tensor_model_parallel_group())")
    assert info.value.waiting == [0]
    world.restart()
    assert world.run("x = torch.tensor([float(rank)]); dist.all_reduce(x); x.item()") == [6.0] * 4


def test_jupyters_cluster_extension_never_sees_the_world(world):
    # JupyterLab's ipyparallel extension lists the clusters whose files it finds in a
    # profile's security folder (ClusterManager.load_clusters) and watches their processes;
    # a world it saw was reported, engine logs and all, in the server's terminal at stop.
    from ipyparallel.cluster.cluster import ClusterManager
    found = ClusterManager().load_clusters(profile_dirs=[world.cluster.profile_dir])
    assert [key for key in found if world.cluster.cluster_id in key] == []


def test_stop_ends_every_engine_and_the_controller(world):
    pids = world.process_tree()      # engines, their nannies, the controller and its schedulers
    assert set(world.pids + [world.controller_pid]) < set(pids)
    assert all(psutil.pid_exists(p) for p in pids)
    world.stop()
    assert [p for p in pids if not _gone(p)] == []
    with pytest.raises(playground.PlaygroundError, match="stopped"):
        world.run("rank")


EXIT_SCRIPT = """
import json
from mpu_lab.labkit import playground
world = playground.start_world(2, timeout_s=5)
old = world.process_tree()
world.restart(hard=True)          # new engines and controller
new = world.process_tree()
print(json.dumps({"old": old, "new": new, "sum": world.run("x = torch.ones(1); dist.all_reduce(x); x.item()")}))
# no world.stop(): leaving the interpreter must end the engines and the controller
"""



def test_hard_restart_replaces_the_engines_and_interpreter_exit_leaves_no_process(tmp_path):
    import json
    import subprocess
    import sys
    env = _child_env()
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["sum"] == [2.0, 2.0]
    assert not set(got["old"]) & set(got["new"]) and len(got["new"]) > 3
    assert [p for p in got["old"] + got["new"] if not _gone(p)] == []


KILLED_SCRIPT = """
import json, time
from mpu_lab.labkit import playground
world = playground.start_world(2, timeout_s=5)
print(json.dumps(world.process_tree()), flush=True)
time.sleep(600)
"""


def test_a_world_whose_owner_is_killed_ends_with_it():
    """A kernel (or a test) killed by a signal never runs its exit handler, which stops the
    world: each engine watches the process that started it and, once it is gone, stops the
    controller and ends itself; the nannies and schedulers follow."""
    import json
    import signal
    import subprocess
    import sys
    env = _child_env()
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SCRIPT], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        tree = json.loads(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(tree) > 3
    deadline = time.monotonic() + 20
    while [p for p in tree if not _gone(p)] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [p for p in tree if not _gone(p)] == []


STOP_SCRIPT = """
import sys
from mpu_lab.labkit import playground
world = playground.start_world(2, timeout_s=5)
world.run("x = torch.ones(1); dist.all_reduce(x)")
print("<stop>", file=sys.stderr, flush=True)
world.stop()
print("</stop>", file=sys.stderr, flush=True)
"""


def test_stop_writes_nothing_to_the_parents_stderr(tmp_path):
    import subprocess
    import sys
    env = _child_env()
    proc = subprocess.run([sys.executable, "-c", STOP_SCRIPT], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    during_stop = proc.stderr.split("<stop>\n", 1)[1].split("</stop>", 1)[0]
    assert during_stop == ""


def test_stop_does_not_report_a_log_file_someone_else_already_removed(caplog):
    import logging

    from mpu_lab.labkit.playground.cluster_logs import quiet_about_removed_logs
    log = logging.getLogger("ipyparallel.cluster.cluster.test-quiet")
    quiet_about_removed_logs(log)
    with caplog.at_level(logging.ERROR, logger=log.name):
        log.error("Failed to remove /tmp/ipcontroller-1.log: [Errno 2] No such file or directory")
        log.error("Failed to remove /tmp/ipcontroller-1.log: [Errno 13] Permission denied")
    assert [r.getMessage() for r in caplog.records] == [
        "Failed to remove /tmp/ipcontroller-1.log: [Errno 13] Permission denied"]


def _setup_that_hangs_the_first_time(env, owner=None, flags=""):
    """Shipped to the engines in place of engine_setup (ipyparallel sends its code): each rank's
    first engine writes its PID to a flag file and never answers, as an engine under load once
    did in CI; an engine of the same rank started later finds the flag and sets up."""
    import os
    import time
    flag = os.path.join(flags, f"rank{env['RANK']}")
    if not os.path.exists(flag):
        with open(flag, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)
    from mpu_lab.labkit.playground.engine import engine_setup
    return engine_setup(env, owner)


def test_a_start_whose_engines_do_not_answer_is_made_again_from_fresh_engines(tmp_path,
                                                                              monkeypatch):
    from mpu_lab.labkit.playground import world as world_module
    hang = ipyparallel.interactive(_setup_that_hangs_the_first_time)   # sent as code
    hang.__defaults__ = (None, str(tmp_path))
    monkeypatch.setattr(world_module, "engine_setup", hang)
    w = playground.start_world(2, timeout_s=5, start_timeout_s=10)
    try:
        assert w.timings["start_attempts"] == 2
        assert w.run("x = torch.ones(1); dist.all_reduce(x); x.item()") == [2.0, 2.0]
        first = [int((tmp_path / f"rank{r}").read_text()) for r in range(2)]
        assert not set(first) & set(w.pids)
        assert [p for p in first if not _gone(p)] == []     # the silent engines were stopped
    finally:
        w.stop()


class _Dropped:
    """An AsyncResult for a request the scheduler dropped: never ready."""

    def ready(self):
        return False


def test_a_setup_request_the_scheduler_dropped_is_sent_again(monkeypatch):
    """ipyparallel may announce an engine before it is connected to the scheduler, which then
    drops a request routed to it (ipyparallel issue #476): here each rank's first setup
    request is dropped on purpose; the world still starts, in its first attempt."""
    from mpu_lab.labkit.playground import world as world_module
    real = ipyparallel.DirectView.apply_async
    sends = []

    def apply_async(view, f, *args, **kwargs):
        if f is world_module.engine_setup:
            sends.append(view.targets)
            if sends.count(view.targets) == 1:
                return _Dropped()
        return real(view, f, *args, **kwargs)

    monkeypatch.setattr(ipyparallel.DirectView, "apply_async", apply_async)
    w = playground.start_world(2, timeout_s=5, start_timeout_s=60)
    try:
        assert w.timings["start_attempts"] == 1
        assert sorted(sends) == sorted(w.engine_ids * 2)
        assert w.run("x = torch.ones(1); dist.all_reduce(x); x.item()") == [2.0, 2.0]
    finally:
        w.stop()


def test_a_world_that_never_starts_says_what_did_not_answer_and_leaves_no_process():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(playground.WorldStartTimeout) as err:
        playground.start_world(2, start_timeout_s=0.01)   # no engine registers that fast
    assert str(err.value).startswith("the world's engines did not start: only ")
    assert "engines registered within 0.01 s (tried 2 times" in str(err.value)
    assert "start_timeout_s=0.02" in str(err.value)
    assert err.value.late == [0, 1]
    left = [p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and not _gone(p.pid)]
    assert left == []


def test_a_start_is_made_again_only_for_a_group_that_failed_on_a_connection():
    """What an engine's failed ``init_process_group`` sends back (ipyparallel's RemoteError,
    named by the rank's exception class) decides whether ``start`` tries fresh engines: the
    port taken before rank 0 bound it, or gloo's lost peer, yes; any other error, no."""
    from ipyparallel.error import RemoteError
    from mpu_lab.labkit.playground.world import connection_failed
    taken = RemoteError("DistNetworkError", "The server socket has failed to listen on any "
                        "local network address. port: 29500, name: EADDRINUSE", "")
    mesh = RemoteError("RuntimeError", "Gloo connectFullMesh failed with ... Connection "
                       "closed by peer", "")
    assert connection_failed(taken) and connection_failed(mesh)
    assert not connection_failed(RemoteError("ValueError", "tp=3 does not divide 4", ""))
    assert not connection_failed(KeyError("backend"))
