"""Shared fixtures for the package tests."""
import os

import pytest


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo world with model parallel initialised (TP=PP=1), torn down after the
    module together with the environment variables it set, so later tests start clean."""
    from mpu_lab import distributed, training
    before = dict(os.environ)
    training.init_single_process(backend="gloo")
    yield
    distributed.shutdown()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key not in before:
            os.environ.pop(key, None)


# --------------------------------------------------------------------------- parallel run
# `python -m pytest` runs on two pytest-xdist workers (pyproject addopts: -n 2 --dist loadfile):
# most of the suite waits — on torchrun starting ranks that import torch one core at a time,
# on collective timeouts, on notebook kernels — so two workers overlap what one leaves idle.
# A file is one unit of work (module fixtures such as a torchrun job run once); a notebook is
# one too (its cells share a kernel, in order). Units are handed out longest first, so no
# long one starts last: the seconds below were measured one unit at a time on the 2-core
# machine (a unit not listed counts as short).
EXPECTED_SECONDS = {
    "tests/test_reliability.py": 150, "tests/test_gpt_pipeline_mp.py": 60,
    "tests/test_gpt_mp.py": 50, "labs/08_performance.ipynb": 50, "labs/07_train_gpt.ipynb": 47,
    "tests/test_playground.py": 45, "labs/04_collectives.ipynb": 43,
    "labs/02_column_parallel.ipynb": 29, "tests/test_perf_measure.py": 28,
    "labs/03_row_parallel.ipynb": 23, "tests/test_launch.py": 22,
    "tests/test_tensor_parallel_mp.py": 19, "tests/test_layer_and_training_views.py": 18,
    "labs/05_parallel_transformer.ipynb": 17, "tests/test_parallel_state_mp.py": 15,
    "labs/06_pipeline_parallel.ipynb": 15, "labs/01_rank_groups.ipynb": 14,
    "tests/test_pipeline_mp.py": 12, "tests/test_perf_model.py": 9, "Start_Here.ipynb": 9,
}


def _unit(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Longest units first (a stable sort: each unit's items keep their order)."""
    items.sort(key=lambda item: -EXPECTED_SECONDS.get(_unit(item.nodeid), 0))


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, handing the units out in collection order (longest first, above)
    instead of xdist's most-tests-first."""
    from xdist.scheduler import LoadScopeScheduling

    class LongestFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return _unit(nodeid)

    config.option.loadscopereorder = False
    return LongestFirst(config, log)
