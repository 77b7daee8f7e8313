"""The expert rank groups of mpu_lab.core.parallel_state_groups: worked by hand, and equal
to Megatron-core's own expert RankGenerator over a sweep of every valid configuration."""
import pytest

from mpu_lab.core.parallel_state import (
    DEFAULT_ORDER, EXPERT_FAMILIES, check_expert_sizes, generate_rank_groups)
from mpu_lab.training.rank_groups_args import check_rank_groups_args

DENSE = ["tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp", "tp-cp", "tp-dp-cp", "embedding",
         "position-embedding"]


def test_the_default_order_is_megatron_cores():
    assert DEFAULT_ORDER == "tp-cp-ep-dp-pp"


# --- worked by hand ------------------------------------------------------------------------
def test_world_8_tp2_ep2_by_hand():
    # expert side: etp = t = 2, ep = 2, edp = 8 / (2·2·1) = 2; rank = etp_r + 2 ep_r + 4 edp_r
    g = generate_rank_groups(8, tensor_model_parallel_size=2, expert_model_parallel_size=2)
    assert g["expert-tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["expert-tp-ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["expert-tp-ep-pp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["expert-dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # dense side unchanged: d = 4, rank = tp_r + 2 dp_r
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_world_8_tp2_ep4_etp1_by_hand():
    # etp = 1, ep = 4, edp = 2; rank = ep_r + 4 edp_r: experts split over what TP splits densely
    g = generate_rank_groups(8, 2, expert_model_parallel_size=4, expert_tensor_parallel_size=1)
    assert g["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["expert-tp"] == [[r] for r in range(8)]
    assert g["expert-dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["expert-tp-ep"] == g["ep"]


def test_world_8_pp2_ep2_by_hand():
    # etp = 1, ep = 2, edp = 8 / (1·2·2) = 2, pp = 2; rank = ep_r + 2 edp_r + 4 pp_r
    g = generate_rank_groups(8, pipeline_model_parallel_size=2, expert_model_parallel_size=2)
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["expert-dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["expert-tp-ep-pp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # the pipeline groups are the dense ones: d = 4, rank = dp_r + 4 pp_r
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_ep_1_expert_groups_fall_back_to_the_dense_ones():
    g = generate_rank_groups(16, 2, 4)
    assert g["expert-tp"] == g["tp"] and g["expert-dp"] == g["dp"]
    assert g["ep"] == [[r] for r in range(16)]
    assert g["expert-tp-ep-pp"] == g["tp-pp"]


@pytest.mark.parametrize("world,tp,pp,cp", [(16, 2, 4, 1), (16, 4, 2, 1), (16, 2, 2, 2),
                                            (8, 2, 2, 1), (12, 3, 2, 1)])
def test_the_dense_keys_do_not_change_with_expert_parallelism(world, tp, pp, cp):
    plain = generate_rank_groups(world, tp, pp, cp, "tp-cp-dp-pp")
    assert generate_rank_groups(world, tp, pp, cp) == plain          # size-1 ep moves nothing
    for ep in (e for e in range(1, world + 1) if world % (tp * pp * e) == 0):
        with_ep = generate_rank_groups(world, tp, pp, cp, expert_model_parallel_size=ep)
        assert {k: with_ep[k] for k in DENSE} == {k: plain[k] for k in DENSE}
        assert set(with_ep) == set(DENSE) | set(EXPERT_FAMILIES)


# --- bad sizes, refused with the numbers ----------------------------------------------------
@pytest.mark.parametrize("kwargs,needle", [
    (dict(world_size=8, tensor_model_parallel_size=2, expert_model_parallel_size=3),
     "world_size 8 is not divisible by expert_tensor_parallel_size 2 x "
     "expert_model_parallel_size 3 x pipeline_model_parallel_size 1 = 6"),
    (dict(world_size=8, pipeline_model_parallel_size=2, expert_model_parallel_size=8),
     "expert_model_parallel_size 8 x pipeline_model_parallel_size 2 = 16"),
    (dict(world_size=8, expert_model_parallel_size=0), "expert_model_parallel_size must be >= 1, got 0"),
    (dict(world_size=8, expert_tensor_parallel_size=0), "expert_tensor_parallel_size must be >= 1"),
    (dict(world_size=8, expert_model_parallel_size=2.0), "positive integer, got 2.0"),
    (dict(world_size=8, expert_model_parallel_size=2, order="tp-cp-dp-pp"),
     "leaves out 'ep', whose size is 2"),
    (dict(world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
          expert_model_parallel_size=2, order="tp-cp-ep-pp-dp"),
     "dp 2 = 8 / (tp 2 x cp 1 x pp 2) but the expert data-parallel size is 1"),
])
def test_bad_expert_sizes_raise_value_error_naming_the_numbers(kwargs, needle):
    with pytest.raises(ValueError) as err:
        generate_rank_groups(**kwargs)
    assert needle in str(err.value)


def test_check_expert_sizes_returns_the_expert_data_parallel_size():
    assert check_expert_sizes(16, 2, 2, 2) == 2             # etp = t = 2
    assert check_expert_sizes(16, 2, 2, 2, 1) == 4
    assert check_expert_sizes(8) == 8


# --- Megatron-core's own generator ------------------------------------------------------------
def _divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def _configs():
    for world in range(1, 17):
        for tp in _divisors(world):
            for pp in _divisors(world // tp):
                for cp in _divisors(world // (tp * pp)):
                    for etp in [None] + _divisors(world // pp):
                        for ep in _divisors(world // (pp * (etp or tp))):
                            yield world, tp, pp, cp, ep, etp


def _megatron_groups(mps, world, tp, pp, cp, ep, etp, order):
    """What Megatron-core's initialize_model_parallel builds, in one process: its two
    RankGenerators and its two consistency checks (None where it would refuse)."""
    dp = world // (tp * pp * cp)
    etp = tp if etp is None else etp
    edp = world // (etp * ep * pp)
    dense = mps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = mps.RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    if not (order.endswith("pp") or pp == 1 or edp == dp):
        return None
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        return None
    out = {key: expert.get_ranks(token) for key, token in EXPERT_FAMILIES.items()}
    out.update({key: dense.get_ranks(key) for key in ("tp", "cp", "dp", "pp", "tp-pp")})
    return out


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])
def test_expert_groups_equal_megatron_cores_rank_generator_over_a_sweep(order):
    mps = pytest.importorskip("megatron.core.parallel_state",
                              reason="megatron-core is not installed (pip install megatron-core)")
    checked = refused = 0
    for world, tp, pp, cp, ep, etp in _configs():
        theirs = _megatron_groups(mps, world, tp, pp, cp, ep, etp, order)
        if theirs is None and ep == 1 and etp in (None, tp):
            # no experts split: the dense layout is accepted as before expert parallelism
            ours = generate_rank_groups(world, tp, pp, cp, order, ep, etp)
            dense = mps.RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp,
                                      order=order)
            assert all(ours[k] == dense.get_ranks(k) for k in ("tp", "cp", "dp", "pp", "tp-pp"))
            continue
        if theirs is None:
            with pytest.raises(ValueError):
                generate_rank_groups(world, tp, pp, cp, order, ep, etp)
            refused += 1
            continue
        ours = generate_rank_groups(world, tp, pp, cp, order, ep, etp)
        assert {k: ours[k] for k in theirs} == theirs, (world, tp, pp, cp, ep, etp, order)
        checked += 1
    assert checked > 1000
    assert (refused > 0) == (order != DEFAULT_ORDER)


# --- launch/rank_groups.py's flags and pre-check ---------------------------------------------
def test_rank_groups_flags_take_the_expert_sizes_under_megatrons_names_too():
    args = check_rank_groups_args(["--tp", "2", "--pp", "1", "--ep", "2"], 4)
    assert (args.ep, args.etp) == (2, None)
    args = check_rank_groups_args(["--tp", "2", "--pp", "1", "--expert-model-parallel-size", "2",
                                   "--expert-tensor-parallel-size", "1"], 4)
    assert (args.ep, args.etp) == (2, 1)
    with pytest.raises(ValueError, match="--ep 4 with --etp 2 does not fit 4 ranks: world size 4 "
                                         "is not divisible by etp x ep x pp = 2 x 4 x 1 = 8"):
        check_rank_groups_args(["--tp", "2", "--pp", "1", "--expert-model-parallel-size", "4"], 4)
