"""Pure rank-group math of mpu_lab.core.parallel_state (no processes started)."""
import itertools

import pytest

from mpu_lab.core.parallel_state import EXPERT_FAMILIES, generate_rank_groups, rank_coordinates

FAMILIES = ["tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp", "tp-cp", "tp-dp-cp",
            "embedding", "position-embedding"]


# --- the MPU walkthrough's 16-GPU tables, verbatim ---------------------------------------
def test_walkthrough_tp2_pp4_groups_verbatim():
    g = generate_rank_groups(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    # model-parallel groups: the walkthrough's "model i is partitioned into gpus ..."
    assert g["tp-pp"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]


def test_walkthrough_tp4_pp2_groups_verbatim():
    g = generate_rank_groups(16, tensor_model_parallel_size=4, pipeline_model_parallel_size=2)
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g["pp"] == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert g["tp-pp"] == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]


def test_group_counts_follow_n_over_size():
    # walkthrough: num_tensor_groups = n/t, num_pipeline_groups = n/p, num_data_groups = n/d
    n, t, p = 16, 2, 4
    d = n // (t * p)
    g = generate_rank_groups(n, t, p)
    assert (len(g["tp"]), len(g["pp"]), len(g["dp"])) == (n // t, n // p, n // d)


def test_embedding_group_is_first_and_last_stage_of_each_pipeline():
    g = generate_rank_groups(16, 2, 4)
    assert g["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert g["position-embedding"] == [[0], [1], [2], [3]]
    g1 = generate_rank_groups(4, 2, 1)          # no pipeline: every rank is its own stage
    assert g1["embedding"] == [[0], [1], [2], [3]]


def test_context_parallel_groups_megatron_order():
    # tp=2, cp=2, pp=2 on 16 ranks (dp=2). With tp-cp-dp-pp, rank = tp + 2cp + 4dp + 8pp.
    g = generate_rank_groups(16, 2, 2, context_parallel_size=2)
    assert g["cp"][:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"][:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp-cp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["tp-cp"][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["tp-dp-cp"] == [list(range(8)), list(range(8, 16))]
    assert g["pp"][:3] == [[0, 8], [1, 9], [2, 10]]


def test_order_tp_pp_dp_puts_pipeline_before_data():
    # Megatron's alternative order "tp-cp-pp-dp": pipeline peers become neighbours-of-tp.
    g = generate_rank_groups(8, 2, 2, order="tp-pp-dp")
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


# --- an independent reference: groups as "ranks that agree on every other coordinate" ------
def _reference(world, tp, pp, cp, order):
    dp = world // (tp * pp * cp)
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    tokens = order.split("-") + [t for t in ("tp", "cp", "dp", "pp") if t not in order.split("-")]
    coords = {}
    for combo in itertools.product(*[range(sizes[t]) for t in tokens]):
        rank, stride = 0, 1
        for t, c in zip(tokens, combo):
            rank += c * stride
            stride *= sizes[t]
        coords[rank] = dict(zip(tokens, combo))
    out = {}
    for fam in FAMILIES[:9]:
        members = fam.split("-")
        key = lambda r: tuple(coords[r][t] for t in tokens if t not in members)
        buckets = {}
        for r in range(world):
            buckets.setdefault(key(r), []).append(r)
        out[fam] = buckets
    return coords, out


CONFIGS = [(8, 2, 2, 1, "tp-cp-dp-pp"), (16, 2, 4, 1, "tp-cp-dp-pp"), (16, 4, 2, 1, "tp-dp-pp"),
           (16, 2, 2, 2, "tp-cp-dp-pp"), (24, 2, 3, 2, "tp-cp-pp-dp"), (12, 3, 2, 1, "pp-tp-dp"),
           (8, 1, 1, 1, "tp-cp-dp-pp"), (32, 4, 2, 2, "dp-tp-cp-pp")]


@pytest.mark.parametrize("world,tp,pp,cp,order", CONFIGS)
def test_every_family_partitions_the_ranks_and_matches_reference(world, tp, pp, cp, order):
    g = generate_rank_groups(world, tp, pp, cp, order)
    assert set(g) == set(FAMILIES) | set(EXPERT_FAMILIES)
    coords, ref = _reference(world, tp, pp, cp, order)
    for fam in FAMILIES[:9]:
        flat = sorted(r for grp in g[fam] for r in grp)
        assert flat == list(range(world)), fam          # a partition: each rank exactly once
        assert sorted(map(sorted, g[fam])) == sorted(map(sorted, ref[fam].values())), fam
        size = 1
        for t in fam.split("-"):
            size *= {"tp": tp, "pp": pp, "cp": cp, "dp": world // (tp * pp * cp)}[t]
        assert all(len(grp) == size for grp in g[fam]), fam
    # inside a pipeline group ranks run stage 0, 1, ...; inside a TP group tp-rank 0, 1, ...
    for grp in g["pp"]:
        assert [coords[r]["pp"] for r in grp] == list(range(pp))
    for grp in g["tp"]:
        assert [coords[r]["tp"] for r in grp] == list(range(tp))
    for r in range(world):
        c = rank_coordinates(r, world, tp, pp, cp, order)
        assert c == {t: coords[r][t] for t in ("tp", "cp", "dp", "pp")}


def test_size_one_dimension_may_be_left_out_of_order():
    assert generate_rank_groups(8, 2, 2, order="tp-dp-pp") == generate_rank_groups(8, 2, 2)


# --- bad configurations raise ValueError naming the numbers --------------------------------
@pytest.mark.parametrize("kwargs,needle", [
    (dict(world_size=8, tensor_model_parallel_size=3), "world_size 8 is not divisible"),
    (dict(world_size=16, tensor_model_parallel_size=2, pipeline_model_parallel_size=3), "= 6"),
    (dict(world_size=8, tensor_model_parallel_size=2, context_parallel_size=3), "context_parallel_size 3"),
    (dict(world_size=8, tensor_model_parallel_size=0), "tensor_model_parallel_size must be >= 1, got 0"),
    (dict(world_size=8, pipeline_model_parallel_size=-2), "pipeline_model_parallel_size must be >= 1, got -2"),
    (dict(world_size=0), "world_size must be >= 1, got 0"),
    (dict(world_size=8, tensor_model_parallel_size=2.0), "positive integer"),
    (dict(world_size=8, order="tp-xp-dp-pp"), "unknown token(s) ['xp']"),
    (dict(world_size=8, order="tp-tp-dp-pp"), "repeats token(s) ['tp']"),
    (dict(world_size=8, tensor_model_parallel_size=2, order="cp-dp-pp"), "leaves out 'tp', whose size is 2"),
])
def test_bad_configuration_raises_value_error_naming_numbers(kwargs, needle):
    with pytest.raises(ValueError) as err:
        generate_rank_groups(**kwargs)
    assert needle in str(err.value)
