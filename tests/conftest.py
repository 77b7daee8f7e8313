"""Shared fixtures for the package tests."""
import os
import pathlib
import re

import pytest


REPO = pathlib.Path(__file__).resolve().parent.parent
# the sources that job processes, notebook kernels and engines import from the checkout
COMPILED = ("mpu_lab", "launch", "tests", "labs/solutions")
_MADE = []   # the folder made below for the learner's package (the workers inherit its name)


def pytest_configure(config):
    """Right answers graded in the tests save their pieces into a throwaway learner's package,
    never into ./my_megatron (mpu_lab.labkit.my_megatron); notebook kernels inherit it.

    The controller (not each xdist worker) first compiles the checkout's sources to bytecode.
    A run starts several hundred interpreters that import mpu_lab (ranks, engines, kernels;
    a rank about 120 of its modules). Python writes those ``.pyc`` files on first import,
    unless ``PYTHONDONTWRITEBYTECODE`` is set, as on the 2-core machine: then each interpreter
    compiles them again, about 0.2 CPU-s (docs/TESTING.md, thirteenth stop). ``compileall``
    writes them once, into the ``__pycache__`` folders Python reads (git ignores them), and
    skips files already compiled; the installed packages were compiled by pip."""
    if not hasattr(config, "workerinput"):
        import compileall
        for folder in COMPILED:
            compileall.compile_dir(str(REPO / folder), quiet=1)
    if "MPU_LAB_MY_MEGATRON" not in os.environ:
        import tempfile
        _MADE.append(tempfile.mkdtemp(prefix="my_megatron_"))
        os.environ["MPU_LAB_MY_MEGATRON"] = os.path.join(_MADE[-1], "my_megatron")


def pytest_unconfigure(config):
    """The learner's package folder goes with the run (the controller's, or -n 0's) that made
    it."""
    import shutil
    for folder in _MADE:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_answer_tries():
    """Each test's checks start with no wrong answers counted (a check shows its answer after
    the second wrong one: mpu_lab.labkit.verdict)."""
    import sys
    module = sys.modules.get("mpu_lab.labkit.verdict")
    if module is not None:
        module.forget_tries()


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo world with model parallel initialised (TP=PP=1), torn down after the
    module together with the environment variables it set, so later tests start clean."""
    from mpu_lab.training import initialize
    before = dict(os.environ)
    initialize.init_single_process(backend="gloo")
    yield
    initialize.shutdown()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key not in before:
            os.environ.pop(key, None)


@pytest.fixture(scope="session")
def eight_rank_job(tmp_path_factory):
    """One 8-rank torchrun job (tests/mp/eight_rank_checks.py) for every 8-rank check: the
    tensor-parallel checks, the real process groups and GPT pipeline training. Returns
    ``(per-rank reports, folder of the job's checkpoint and metrics file)``."""
    import pathlib

    from mpu_lab.launcher import run
    root = tmp_path_factory.mktemp("eight_ranks")
    job = run(pathlib.Path(__file__).parent / "mp" / "eight_rank_checks.py",
              [str(root / "ckpt"), str(root / "metrics.jsonl")], nproc=8, timeout_s=480,
              show="none")
    assert [rep["rank"] for rep in job.results] == list(range(8))
    return job.results, root


@pytest.fixture(scope="session")
def four_rank_job(tmp_path_factory):
    """One 4-rank torchrun job (tests/mp/four_rank_checks.py) for every 4-rank check: GPT
    under TP/SP/DP, the pipeline schedules and the performance measurements, the ranks' CPU use
    sampled from here while it runs. Returns ``(per-rank reports, checkpoint root, trace
    folder, CPU utilisation, runnable-state utilisation)``."""
    import pathlib

    from mpu_lab.launcher import run
    from mpu_lab.perf import utilisation
    root = tmp_path_factory.mktemp("four_ranks")
    ckpt, traces = root / "gpt_ckpt", root / "traces"
    ckpt.mkdir()
    traces.mkdir()
    with utilisation.UtilisationSampler(interval_s=0.05) as cpu, \
            utilisation.UtilisationSampler(interval_s=0.05, cpu_metric="runnable") as runnable:
        job = run(pathlib.Path(__file__).parent / "mp" / "four_rank_checks.py",
                  [str(ckpt), str(traces)], nproc=4, timeout_s=480, show="none")
    assert [rep["rank"] for rep in job.results] == list(range(4))
    return job.results, ckpt, traces, cpu.result(), runnable.result()


_GRADING = {}   # the grading world while its unit runs


@pytest.fixture
def grading_world():
    """One 4-rank playground world (tp = 2, pp = 1, so dp = 2; a 4 s collective timeout) for
    every write-the-code grader test (tests/labkit/<lab>/test_<lab>_exercises.py, in the units
    of GRADING_UNITS below): started by a unit's first test, stopped after its last (pytest_runtest_teardown below),
    so no engine outlives the unit into tests that count this process's children."""
    from mpu_lab.labkit import playground
    world = _GRADING.get("world")
    if world is None or not world.running:
        world = _GRADING["world"] = playground.start_world(4, tensor_model_parallel_size=2,
                                                           timeout_s=4.0)
    return world


def pytest_runtest_teardown(item, nextitem):
    if "world" in _GRADING and (nextitem is None or _unit(nextitem.nodeid) != _unit(item.nodeid)):
        _GRADING.pop("world").stop()


@pytest.fixture(scope="session")
def as_notebook():
    """``as_notebook(source)`` runs ``source`` as a notebook cell would (module ``__main__``) and
    returns its namespace: a function defined there travels to the playground's ranks the way a
    learner's does (its code, with the rank's namespace as its globals)."""
    def define(source: str) -> dict:
        namespace = {"__name__": "__main__"}
        exec(compile(source, "<learner cell>", "exec"), namespace)
        return namespace
    return define


# --------------------------------------------------------------------------- parallel run
# `python -m pytest` runs on pytest-xdist workers (pyproject addopts: -n auto --dist loadfile;
# two on the 2-core machine, see MAX_WORKERS below):
# most of the suite waits — on torchrun starting ranks that import torch one core at a time,
# on collective timeouts, on notebook kernels — so two workers overlap what one leaves idle.
# A file is one unit of work (module fixtures such as a torchrun job run once); a notebook is
# one too (its cells share a kernel, in order); files sharing a session job are one unit.
# Units are handed out longest first, so no long one starts last: the seconds below are each
# unit's wall time in a full run on the 2-core machine (two workers; the Intel one, 2026-11-30,
# after that day's cuts; units under 20 s are not listed and count as short).
EXPECTED_SECONDS = {
    "tests/launcher/test_documented_commands.py": 230, "labs/15_performance.ipynb": 135,
    "labs/04_data_parallel.ipynb": 125, "tests/labkit/playground/test_playground.py": 115,
    "tests/launcher/test_reliability.py": 105, "labs/14_train_gpt.ipynb": 80,
    "labs/12_zero_bubble.ipynb": 80, "labs/05_sharded_data_parallel.ipynb": 75,
    "grading world": 70, "tests/launcher/test_launch.py": 65, "labs/06_column_parallel.ipynb": 60,
    "4-rank job": 60, "labs/13_mixture_of_experts.ipynb": 60, "grading world: builds": 60,
    "labs/08_tp_mappings.ipynb": 55, "labs/17_debugging.ipynb": 55,
    "tests/labkit/capstone/test_capstone_mp.py": 55, "labs/11_pipeline_parallel.ipynb": 50,
    "labs/02_collectives.ipynb": 50, "labs/18_your_megatron.ipynb": 45,
    "tests/training/test_faults.py": 45, "labs/01_rank_groups.ipynb": 40, "8-rank job": 40,
    "tests/models/moe/test_moe_mp.py": 40, "tests/launcher/test_refusal_under_torchrun.py": 35,
    "tests/labkit/notebooks/test_notebook_watchdog.py": 35,
    "tests/distributed/fsdp/test_megatron_fsdp_mp.py": 35,
    "labs/09_parallel_transformer.ipynb": 30, "tests/megatron_reference/test_megatron_moe.py": 30,
    "labs/10_context_parallel.ipynb": 30, "labs/07_row_parallel.ipynb": 30,
    "tests/pipeline_parallel/test_zero_bubble_mp.py": 30, "tests/models/moe/test_gpt_moe_mp.py": 30,
    "tests/labs/test_inner_loop.py": 25, "tests/models/test_gpt_context_parallel_mp.py": 20,
    "labs/03_device_memory.ipynb": 20, "tests/labkit/notebooks/test_notebooks_structure.py": 20,
}


# Files that share a session fixture's job are one unit, so the job starts once.
SHARED_JOBS = {"tests/tensor_parallel/test_tensor_parallel_mp.py": "8-rank job",
               "tests/test_parallel_state_mp.py": "8-rank job",
               "tests/models/test_gpt_pipeline_mp.py": "8-rank job",
               "tests/models/test_gpt_mp.py": "4-rank job",
               "tests/models/test_recompute_mp.py": "4-rank job",
               "tests/pipeline_parallel/test_pipeline_mp.py": "4-rank job",
               "tests/perf/test_perf_measure.py": "4-rank job",
               "tests/optimizer/test_distrib_optimizer.py": "4-rank job"}
# every lab's grader tests, tests/labkit/<lab>/test_<lab>_exercises.py: one world
GRADER_TESTS = re.compile(r"tests/labkit/(\w+)/test_\1_exercises\.py")
# ... split in two units, each with a world of its own, so that two workers share the load:
# the whole-piece builds (issue 42) with the newer labs' graders, next to the first labs' ones
# (a third unit, the newer labs' 20 s, cost a world's start, some 10 CPU-s, for no balance)
GRADING_UNITS = dict.fromkeys(("column_parallel_build", "row_parallel_build", "ddp_build",
                               "mappings_build", "vocab_build", "my_megatron", "device_memory",
                               "sharded_data_parallel", "zero_bubble"),
                              "grading world: builds")


def _unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    match = GRADER_TESTS.fullmatch(path)
    if match:
        return GRADING_UNITS.get(match.group(1), "grading world")
    return SHARED_JOBS.get(path, path)


# --------------------------------------------------------------------------- the inner loop
# `python -m pytest -m "not slow"` keeps one shared multi-rank world, `four_rank_job` (the
# mirror's GPT, pipeline and distributed-optimizer checks against their dense twins). A test
# that needs any other multi-rank job is `slow`: marked here by the fixture that starts the
# job (so a new test using one is slow without anyone remembering to mark it), or with
# `pytest.mark.slow` in its file where the test starts the job itself. Notebooks are slow.
SLOW_FIXTURES = {
    "eight_rank_job", "grading_world",                   # the other two shared worlds
    "tests/training/test_faults.py::fault_jobs",           # eight faulty train_gpt.py jobs
    "tests/perf/test_kernel_timeline.py::pp2_results", # a profiled PP=2 job
    "tests/perf/test_memory_accounting.py::rows",      # 4-rank jobs at three layouts
    "tests/perf/test_dp_overlap.py::result",           # DP jobs with and without overlap
}


def _is_slow(item) -> bool:
    if item.path.suffix == ".ipynb":
        return True
    path = item.nodeid.split("::", 1)[0]
    return any(name in SLOW_FIXTURES or f"{path}::{name}" in SLOW_FIXTURES
               for name in getattr(item, "fixturenames", ()))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Mark the notebook cells ``notebook`` and the slow items (above); then longest units
    first (a stable sort: each unit's items keep their order). Runs before pytest's own ``-m``
    selection (tryfirst), so the markers count there."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: -EXPECTED_SECONDS.get(_unit(item.nodeid), 0))


# `-n auto` (pyproject addopts): one worker per core, at most MAX_WORKERS. A unit may start up
# to 8 ranks that each import torch and then wait in collectives with timeouts of a few
# seconds; more workers would start more jobs side by side than the cores can feed, and a job
# past its timeout fails. Only 2 workers on the 2-core machine have been measured.
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: min(usable cores, MAX_WORKERS); PYTEST_XDIST_AUTO_NUM_WORKERS overrides,
    as in pytest-xdist's own hook."""
    chosen = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if chosen:
        return int(chosen)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, MAX_WORKERS))


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, handing the units out in collection order (longest first, above)
    instead of xdist's most-tests-first."""
    from xdist.scheduler import LoadScopeScheduling

    class LongestFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return _unit(nodeid)

    config.option.loadscopereorder = False
    return LongestFirst(config, log)
