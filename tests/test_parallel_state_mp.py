"""initialize_model_parallel creates real torch.distributed groups equal to the pure math."""
import pytest

from mpu_lab.parallel_state import GROUP_FAMILIES, generate_rank_groups

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reports(eight_rank_job):
    """Each rank's probes (tests/mp/state_checks.py), from the shared 8-rank job
    (tests/mp/eight_rank_checks.py; ``eight_rank_job`` in conftest.py)."""
    return [rep["state"] for rep in eight_rank_job[0]]


CONFIGS = [dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=2),
           dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4),
           dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2)]


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_real_groups_equal_generated_groups_on_8_ranks(reports, index):
    cfg = CONFIGS[index]
    expected = generate_rank_groups(8, **cfg)
    for rank, per_cfg in enumerate(reports):
        got = per_cfg[index]
        assert got["rank"] == rank
        for fam in GROUP_FAMILIES:
            mine = [g for g in expected[fam] if rank in g]
            assert got["groups"][fam] == (mine[0] if mine else None), (rank, fam)
        in_embedding = any(rank in g for g in expected["embedding"])
        assert ("embedding" in got["torch_group_ranks"]) == in_embedding
        for fam, ranks in got["torch_group_ranks"].items():
            (mine,) = [g for g in expected[fam] if rank in g]
            assert sorted(ranks) == sorted(mine), (rank, fam)
            assert got["group_sums"][fam] == float(sum(mine)), (rank, fam)   # the group really talks
        pp = [g for g in expected["pp"] if rank in g][0]
        assert got["first"] == (pp[0] == rank) and got["last"] == (pp[-1] == rank)
        i = pp.index(rank)
        assert got["next"] == pp[(i + 1) % len(pp)] and got["prev"] == pp[(i - 1) % len(pp)]
        assert got["src"] == [g for g in expected["tp"] if rank in g][0][0]
        assert got["sizes"]["tp"] == cfg["tensor_model_parallel_size"]
        assert got["sizes"]["dp"] == 8 // (cfg["tensor_model_parallel_size"] * cfg["pipeline_model_parallel_size"] * cfg.get("context_parallel_size", 1))
        assert got["initialized_after_destroy"] is False
