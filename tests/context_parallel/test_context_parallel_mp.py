"""mpu_lab.core.context_parallel on real ranks (gloo): ``attention`` against full causal attention
over the whole sequence in one process (fp64 SDPA and its autograd gradients, re-split in
Megatron's layout), forward and q/k/v gradients, at cp = 2 and cp = 4 and with the CP group
inside a tp = 2 x cp = 2 world; ``get_batch_on_this_cp_rank`` on the real CP group; bad inputs
refused on every rank before any collective. One torchrun job per world size
(tests/mp/cp_checks.py); each test reads the ranks' reports.
"""
import pathlib

import pytest

from mpu_lab.core import context_parallel
from mpu_lab.launcher import run

pytestmark = pytest.mark.slow

TOL = 1e-5     # fp32 against the fp64 reference
WORKER = pathlib.Path(__file__).resolve().parents[1] / "mp" / "cp_checks.py"
_JOBS = {}


def reports(world):
    """The per-rank reports of the ``world``-rank job, started once for this module."""
    if world not in _JOBS:
        job = run(WORKER, [], nproc=world, timeout_s=300, show="none")
        assert [rep["rank"] for rep in job.results] == list(range(world))
        _JOBS[world] = job.results
    return _JOBS[world]


def errors(world, name):
    """The check's ``{"out", "dq", "dk", "dv"}`` errors per rank, after asserting it ran."""
    entries = [rep["attention"][name] for rep in reports(world)]
    failures = {rank: e["error"] + "\n" + e["traceback"] for rank, e in enumerate(entries)
                if not e["ok"]}
    assert not failures, f"{name} raised: {failures}"
    return [e["values"] for e in entries]


CASES = [(world, prefix, comm_type, mask)
         for world, prefix in ((2, "cp2"), (4, "cp4"), (4, "tp2-cp2"))
         for comm_type in context_parallel.COMM_TYPES for mask in ("causal", "full")]


@pytest.mark.parametrize("world, prefix, comm_type, mask", CASES,
                         ids=[f"{p}-{c}-{m}" for _, p, c, m in CASES])
def test_attention_output_and_qkv_grads_equal_dense_attention_resplit(world, prefix, comm_type,
                                                                      mask):
    per_rank = errors(world, f"{prefix}/{comm_type}/{mask}")
    for rank, errs in enumerate(per_rank):
        assert set(errs) == {"out", "dq", "dk", "dv"}
        worst = {k: e for k, e in errs.items() if not e <= TOL}
        assert not worst, f"rank {rank}: errors above {TOL:g}: {worst}"


def test_tp2_cp2_world_has_cp_groups_of_non_adjacent_ranks():
    # Megatron's order tp-cp-dp-pp: tp varies fastest, so cp pairs ranks 2 apart
    assert [rep["tp2_cp_group"] for rep in reports(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]


@pytest.mark.parametrize("world, expected", [
    (2, [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]),
    (4, [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]])])
def test_get_batch_on_the_real_cp_group_gives_megatrons_layout(world, expected):
    batches = [rep["batch"] for rep in reports(world)]
    assert [b["position_ids"] for b in batches] == expected
    assert [b["tokens"] for b in batches] == expected
    assert [b["labels"] for b in batches] == [[100 + p for p in pos] for pos in expected]
    assert [b["loss_mask"] for b in batches] == [[float(p % 3 == 0) for p in pos]
                                                 for pos in expected]


@pytest.mark.parametrize("world", [2, 4])
def test_bad_inputs_raise_on_every_rank_before_any_collective(world):
    cp = world
    for rep in reports(world):
        bad = rep["bad_inputs"]
        assert bad["odd_sequence"] is not None and "s/cp = 3" in bad["odd_sequence"] \
            and f"2*cp = {2 * cp}" in bad["odd_sequence"]
        assert f"n={cp + 1} heads is not divisible by cp={cp}" in bad["a2a_heads"]
        assert "unknown comm_type 'ring'" in bad["comm_type"]
        assert f"s={2 * cp + 2} is not divisible by 2*cp = {2 * cp} (cp={cp})" in bad["batch_length"]


@pytest.mark.parametrize("world", [2, 4])
def test_messages_per_comm_type_match_the_formulas(world):
    """Per rank and attention call, with E = (s/cp) * b * n * d elements in each of q, k, v
    (s/cp = 8, b = 2, n = 4, d = 8: E = 512): the ring sends K and V (2E) cp - 1 times forward;
    backward the same again plus dK, dV (2E) cp - 1 times (TransformerEngine's count: a rank's
    share of its own block's gradient stays at home). a2a: q, k, v (3E) and the output (E)
    forward, the same back. allgather: K and V (2E) gathered; backward a reduce-scatter of
    their gradient for the whole sequence (2E * cp)."""
    cp, e = world, 8 * 2 * 4 * 8
    expected = {
        "p2p": {"forward": {"send_recv_async": [cp - 1, (cp - 1) * 2 * e]},
                "backward": {"send_recv_async": [cp - 1, (cp - 1) * 2 * e],
                             "send_recv": [cp - 1, (cp - 1) * 2 * e]}},
        "a2a": {"forward": {"all_to_all": [2, 3 * e + e]},
                "backward": {"all_to_all": [2, e + 3 * e]}},
        "allgather": {"forward": {"all_gather": [1, 2 * e]},
                      "backward": {"reduce_scatter": [1, 2 * e * cp]}}}
    for rep in reports(world):
        assert rep["messages"] == expected, f"rank {rep['rank']}"
