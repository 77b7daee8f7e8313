"""mpu_lab.core.tensor_parallel on 8 real ranks (gloo), against Megatron's unit-test values and
dense single-process twins. tests/mp/tp_checks.py's checks run for tp=4/pp=2 and for tp=2/pp=4
in the shared 8-rank job (tests/mp/eight_rank_checks.py); each test below reads the per-rank
reports, in rank order.
Reported errors are max|parallel - dense| / max(1, max|dense|) (fp32: relative above 1).
"""
import pytest

pytestmark = pytest.mark.slow

LAYOUTS = ["tp4-pp2", "tp2-pp4"]
TP_GROUPS = {"tp4-pp2": [[0, 1, 2, 3], [4, 5, 6, 7]],
             "tp2-pp4": [[0, 1], [2, 3], [4, 5], [6, 7]]}


@pytest.fixture(scope="module")
def reports(eight_rank_job):
    """Each rank's ``{"rank", "checks"}`` from the shared 8-rank job (tests/mp/
    eight_rank_checks.py runs tests/mp/tp_checks.py's checks first; ``eight_rank_job`` in
    conftest.py), in rank order."""
    reports = [{"rank": rep["rank"], "checks": rep["tp"]} for rep in eight_rank_job[0]]
    assert [rep["rank"] for rep in reports] == list(range(8))
    return reports


def values(reports, layout, check):
    """The check's values on ranks 0..7, after asserting it passed on every rank."""
    entries = [rep["checks"][f"{layout}/{check}"] for rep in reports]
    failures = {rank: e["error"] for rank, e in enumerate(entries) if not e["ok"]}
    assert not failures, f"{layout}/{check} failed: {failures}"
    return [e["values"] for e in entries]


def group_of(layout, rank):
    return next(g for g in TP_GROUPS[layout] if rank in g)


# --- Megatron's unit tests (the TP notebook's TEST_* runs) --------------------------------
def test_copy_to_backward_sums_tp_group_6_and_22(reports):
    assert values(reports, "tp4-pp2", "copy_to_backward") == [6, 6, 6, 6, 22, 22, 22, 22]


def test_copy_to_backward_sums_tp_group_with_tp2(reports):
    assert values(reports, "tp2-pp4", "copy_to_backward") == [1, 1, 5, 5, 9, 9, 13, 13]


def test_reduce_from_forward_sums_tp_group_6_and_22(reports):
    assert values(reports, "tp4-pp2", "reduce_from_forward") == [6, 6, 6, 6, 22, 22, 22, 22]
    assert values(reports, "tp2-pp4", "reduce_from_forward") == [1, 1, 5, 5, 9, 9, 13, 13]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_keeps_column_rank_mod_tp(reports, layout):
    tp = len(TP_GROUPS[layout][0])
    assert values(reports, layout, "scatter_keeps_own_column") == [r % tp for r in range(8)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_concatenates_tp_group_in_rank_order(reports, layout):
    assert values(reports, layout, "gather_concatenates_group") == \
        [group_of(layout, r) for r in range(8)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sequence_parallel_scatter_gather_reduce_scatter(reports, layout):
    tp = len(TP_GROUPS[layout][0])
    got = values(reports, layout, "sequence_parallel_trio")
    assert [v["scatter_rows"] for v in got] == [[2 * (r % tp), 2 * (r % tp) + 2] for r in range(8)]
    assert [v["reduce_scatter_value"] for v in got] == [tp * (r % tp) for r in range(8)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_broadcast_data_delivers_src_rank_dict_to_tp_group(reports, layout):
    got = values(reports, layout, "broadcast_data")
    srcs = [group_of(layout, r)[0] for r in range(8)]
    assert [v["src"] for v in got] == srcs
    assert [v["tokens00"] for v in got] == [1000 * s for s in srcs]


def test_gather_split_1d_tensor_concatenates_tp2_group(reports):
    # the notebook's TEST_GATHER_SPLIT run: tp=2/pp=4, (2, 4) tensors of the rank value
    assert values(reports, "tp2-pp4", "gather_split_1d") == \
        [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]]
    assert values(reports, "tp4-pp2", "gather_split_1d") == [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4


# --- layers against dense twins -----------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_column_parallel_output_equals_dense_matmul_bit_exact(reports, layout):
    for v in values(reports, layout, "column_parallel_matches_dense"):
        assert v["bit_exact"] is True
        assert max(v["input_grad"], v["weight_grad"], v["bias_grad"]) <= 1e-6


@pytest.mark.parametrize("layout", LAYOUTS)
def test_row_parallel_output_and_grads_match_dense_within_1e6(reports, layout):
    for v in values(reports, layout, "row_parallel_matches_dense"):
        assert max(v.values()) <= 1e-6, v


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shards_are_slices_of_master_weight_with_stride_1_and_3(reports, layout):
    tp = len(TP_GROUPS[layout][0])
    got = values(reports, layout, "shards_are_master_slices")
    for rank, v in enumerate(got):
        assert v["stride1"]["column"] == [24 // tp, 16] and v["stride1"]["row"] == [16, 24 // tp]
        assert v["stride1"]["column_rows"][0] == (rank % tp) * (24 // tp)
    # stride 3 (fused [Q; K; V]): rank r holds its slice of each of the three blocks
    first = got[0]["stride3"]["column_rows"]
    assert len(first) == 24 // tp and first[:8 // tp] == list(range(8 // tp))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sequence_parallel_mlp_matches_dense(reports, layout):
    for v in values(reports, layout, "sequence_parallel_mlp_matches_dense"):
        assert max(v.values()) <= 1e-6, v


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sequence_parallel_column_keeps_only_the_block_and_regathers_in_backward(reports, layout):
    """A [16, 2, 32] input split t ways: autograd keeps the rank's block, 16 * 2 * 32 / t
    elements (512 at t = 2, 256 at t = 4), not the gathered 1,024; backward gathers it again
    and reduce-scatters the input gradient (one each, no all-reduce)."""
    tp = len(TP_GROUPS[layout][0])
    for v in values(reports, layout, "sequence_parallel_column_keeps_only_its_block"):
        assert v["saved_elements"] == [16 * 2 * 32 // tp], v["saved_elements"]
        assert max(v["errors"].values()) <= 1e-6, v["errors"]
        assert v["weight_grad_is_none_when_fused"] is True
        assert v["backward_collectives"] == {"all_gather": 1, "reduce_scatter": 1,
                                             "all_reduce": 0}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_mlp_issues_one_all_reduce_forward_and_one_backward(reports, layout):
    for v in values(reports, layout, "mlp_uses_one_all_reduce_each_way"):
        assert v["forward_all_reduce"] == v["backward_all_reduce"] == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vocab_parallel_cross_entropy_equals_dense_with_and_without_label_smoothing(reports, layout):
    for v in values(reports, layout, "vocab_parallel_cross_entropy_matches_dense"):
        assert set(v) == {"loss_ls0.0", "loss_ls0.1", "grad_ls0.0", "grad_ls0.1"}
        assert max(v.values()) <= 1e-6, v


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vocab_parallel_embedding_equals_f_embedding(reports, layout):
    tp = len(TP_GROUPS[layout][0])
    got = values(reports, layout, "vocab_parallel_embedding_matches_dense")
    per = 32 // tp
    assert [v["rows"] for v in got] == [[(r % tp) * per, (r % tp + 1) * per] for r in range(8)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dropout_differs_across_tp_ranks_only_inside_rng_fork(reports, layout):
    got = values(reports, layout, "rng_tracker_forks_per_tp_rank")
    assert len({v["kept_outside"] for v in got}) == 1     # one default stream everywhere


def test_every_check_ran_in_both_layouts(reports):
    names = set(reports[0]["checks"])
    per_layout = {layout: {n.split("/", 1)[1] for n in names if n.startswith(layout + "/")}
                  for layout in LAYOUTS}
    assert per_layout["tp4-pp2"] == per_layout["tp2-pp4"] and len(per_layout["tp4-pp2"]) >= 14
    assert all(set(rep["checks"]) == names for rep in reports)
