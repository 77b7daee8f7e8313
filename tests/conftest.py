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
