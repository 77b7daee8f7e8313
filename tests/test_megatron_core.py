"""mpu_lab next to the real Megatron-core (mpu_lab.labkit.megatron_core and
launch/megatron_core_side_by_side.py). Skipped where megatron-core is not installed (it is
optional: `pip install megatron-core`).

The reference here is Megatron-core itself: its RankGenerator for the rank groups (pure), and
its ColumnParallelLinear / RowParallelLinear / mappings on a real 4-rank gloo world (one job).
"""
import pytest

pytest.importorskip("megatron.core")

from mpu_lab import launcher  # noqa: E402
from mpu_lab.labkit import megatron_core as mc  # noqa: E402

TOL = 1e-6   # fp32


@pytest.mark.parametrize("world,tp,pp,cp,order", [
    (16, 2, 4, 1, "tp-cp-dp-pp"),    # the MPU walkthrough's first example
    (16, 4, 2, 1, "tp-cp-dp-pp"),    # and its second
    (16, 2, 2, 2, "tp-cp-dp-pp"),    # context parallel: dp-cp, tp-cp, tp-dp-cp differ from dp...
    (16, 2, 2, 2, "tp-dp-cp-pp"),    # ... and another order of the same sizes
])
def test_rank_groups_equal_megatron_core_rank_generator(world, tp, pp, cp, order):
    table = mc.rank_groups_side_by_side(world, tp, pp, cp=cp, order=order)
    unequal = {k: f for k, f in table["families"].items() if not f["equal"]}
    assert unequal == {}
    assert table["all_equal"]
    assert set(table["families"]) == set(mc.TOKENS)


def test_walkthrough_groups_read_the_same_in_both():
    fams = mc.rank_groups_side_by_side(16, 2, 4)["families"]
    assert fams["tp"]["megatron_core"][:3] == [[0, 1], [2, 3], [4, 5]]
    assert fams["pp"]["megatron_core"][0] == [0, 4, 8, 12]
    assert fams["dp"]["megatron_core"][:2] == [[0, 2], [1, 3]]
    assert fams["embedding"]["megatron_core"][0] == [0, 12]
    fams = mc.rank_groups_side_by_side(16, 4, 2)["families"]
    assert fams["tp"]["megatron_core"][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert fams["pp"]["megatron_core"][0] == [0, 8]
    fams = mc.rank_groups_side_by_side(16, 2, 2, cp=2)["families"]
    assert fams["cp"]["megatron_core"][0] == [0, 2]
    assert fams["dp-cp"]["megatron_core"][0] == [0, 2, 4, 6]
    assert "tp-dp-cp" in mc.format_rank_groups(mc.rank_groups_side_by_side(16, 2, 2, cp=2))


def test_layers_and_mappings_equal_megatron_core_on_four_ranks():
    """One job: TP=2 on 4 ranks (dp=2), plain and sequence-parallel layers, all mappings."""
    job = launcher.run("megatron_core_side_by_side.py",
                       ["--what", "all", "--tp", "2", "--sequence-parallel"], nproc=4)
    results = job.results
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert [r["column"]["tp_rank"] for r in results] == [0, 1, 0, 1]
    for r in results:
        assert r["groups_equal"], r
        for kind in mc.LINEAR_KINDS:
            c = r[kind]
            assert c["same_init"], (kind, c)   # Megatron-core's own CPU init: the same shard
            for key in ("output", "input_grad", "weight_grad", "bias_grad"):
                assert c[key] <= TOL, (r["rank"], kind, key, c)
        assert set(r["mappings"]) == set(mc.MAPPINGS)
        for name, m in r["mappings"].items():
            assert m["forward"] <= TOL and m["backward"] <= TOL, (r["rank"], name, m)
    table = mc.format_results(results)
    assert "column parallel linear + sequence parallel" in table
    assert "reduce_scatter_sp" in table
    assert mc.format_results(results, what="row").count("row parallel linear") == 2


def test_without_megatron_core_the_kit_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(mc.importlib.util, "find_spec", lambda name: None)
    assert not mc.available()
    with pytest.raises(ImportError, match="pip install megatron-core"):
        mc.rank_groups_side_by_side(8, 2, 2)
    skipped = [{"rank": 0, "skipped": mc.INSTALL_HINT}, {"rank": 1, "skipped": mc.INSTALL_HINT}]
    assert mc.format_results(skipped) == mc.INSTALL_HINT
    assert "optional" in mc.INSTALL_HINT
