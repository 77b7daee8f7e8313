"""mpu_lab.core.transformer.moe.MoELayer on real ranks (gloo) against a plain single-process MoE from the
same master weights (tests/mp/moe_reference.py: loops over tokens and experts, fp64): at
ep = 2 and 4, with etp = 1 and etp = 2 (sequence parallel on, t = 2), both dispatchers, top-1
and top-2 (softmax and sigmoid), without and with token dropping, the output, the input
gradient and the router and expert gradients after the data-parallel reductions, within 1e-5;
with a capacity factor, exactly the reference's (token, expert) pairs kept. One torchrun job
per world size (tests/mp/moe_checks.py); each test reads the ranks' reports. The layer next to
Megatron-core's own MoELayer, in all ten cases that run on 4 CPU ranks, is
tests/megatron_reference/test_megatron_moe.py's (one job with the documented command's cases).
"""
import pathlib
import sys

import pytest

from mpu_lab.launcher import run

MP = pathlib.Path(__file__).resolve().parents[2] / "mp"
sys.path.insert(0, str(MP))
import moe_checks  # noqa: E402  (the worker's case list, imported from its folder)

pytestmark = pytest.mark.slow

TOL = 1e-5
WORKER = MP / "moe_checks.py"
_JOBS = {}


def reports(world):
    """The per-rank reports of the ``world``-rank job, started once for this module."""
    if world not in _JOBS:
        job = run(WORKER, [], nproc=world, timeout_s=480, show="none")
        assert [rep["rank"] for rep in job.results] == list(range(world))
        _JOBS[world] = job.results
    return _JOBS[world]


CASES = [(world, name) for world in (4, 8) for name in moe_checks.case_names(world)]


@pytest.mark.parametrize("world, case", CASES, ids=[name for _, name in CASES])
def test_moe_layer_output_and_grads_equal_single_process_moe(world, case):
    for rank, rep in enumerate(reports(world)):
        values = rep["cases"][case]
        worst = {k: values[k] for k in ("out", "dx", "router", "fc1", "fc2")
                 if not values[k] <= TOL}
        assert not worst, f"rank {rank}: errors above {TOL:g}: {worst}"


@pytest.mark.parametrize("world, case", [c for c in CASES if c[1].endswith("capacity1.0")],
                         ids=[name for _, name in CASES if name.endswith("capacity1.0")])
def test_capacity_factor_drops_exactly_the_reference_tokens(world, case):
    per_rank = [rep["cases"][case] for rep in reports(world)]
    assert per_rank[0]["dropped"] > 0, "the capacity factor dropped nothing: the case tests nothing"
    assert [v["kept_equal"] for v in per_rank] == [True] * world


def test_dropless_cases_drop_nothing():
    for world in (4, 8):
        for case, values in reports(world)[0]["cases"].items():
            if case.endswith("dropless"):
                assert values["dropped"] == 0, case


@pytest.mark.parametrize("world, layout", [(4, "tp1-ep2-etp1"), (8, "tp2-ep2-etp2")])
def test_layouts_where_expert_data_parallel_group_differs_from_dense_one(world, layout):
    # The expert gradients above equal the reference there only if they are summed over the
    # expert-data-parallel group: over the dense one they would mix different experts.
    groups = [rep["groups"][layout] for rep in reports(world)]
    assert all(g["dp"] != g["expert-dp"] for g in groups)
    assert all(len(g["expert-dp"]) < len(g["dp"]) for g in groups)
