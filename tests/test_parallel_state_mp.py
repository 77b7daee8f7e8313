"""initialize_model_parallel creates real torch.distributed groups equal to the pure math."""
import pytest

from mpu_lab.core.parallel_state import GROUP_FAMILIES, generate_rank_groups

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reports(eight_rank_job):
    """Each rank's probes (tests/mp/state_checks.py), from the shared 8-rank job
    (tests/mp/eight_rank_checks.py; ``eight_rank_job`` in conftest.py)."""
    return [rep["state"] for rep in eight_rank_job[0]]


CONFIGS = [dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=2),
           dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4),
           dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2),
           # experts split 4 ways, each whole (etp 1): expert-dp [[0, 4], ...] is not dense dp
           dict(tensor_model_parallel_size=2, expert_model_parallel_size=4,
                expert_tensor_parallel_size=1)]


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
        assert got["sizes"]["dp"] == 8 // (cfg["tensor_model_parallel_size"] * cfg.get("pipeline_model_parallel_size", 1) * cfg.get("context_parallel_size", 1))
        assert got["initialized_after_destroy"] is False
        # the expert getters: sizes from the configuration, this rank's place in each group
        etp = cfg.get("expert_tensor_parallel_size") or cfg["tensor_model_parallel_size"]
        ep = cfg.get("expert_model_parallel_size", 1)
        pp = cfg.get("pipeline_model_parallel_size", 1)
        assert (got["sizes"]["ep"], got["sizes"]["etp"], got["sizes"]["edp"]) == \
            (ep, etp, 8 // (etp * ep * pp))
        for fam, place in got["expert_ranks"].items():
            (mine,) = [g for g in expected[fam] if rank in g]
            assert place == mine.index(rank), (rank, fam)
        assert {"ep", "expert-tp", "expert-tp-ep", "expert-dp"} <= set(got["torch_group_ranks"])


def test_expert_groups_on_8_ranks_by_hand(reports):
    # tp 2, ep 4, etp 1 (the last configuration): rank = ep_r + 4 edp_r on the expert side
    for rank, per_cfg in enumerate(reports):
        got = per_cfg[3]["torch_group_ranks"]
        assert got["ep"] == ([0, 1, 2, 3] if rank < 4 else [4, 5, 6, 7])
        assert got["expert-dp"] == [rank % 4, rank % 4 + 4]
        assert got["expert-tp"] == [rank]
        assert got["dp"] == [rank % 2, rank % 2 + 2, rank % 2 + 4, rank % 2 + 6]   # dense d = 4
