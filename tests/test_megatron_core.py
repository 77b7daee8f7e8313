"""mpu_lab next to the real Megatron-core (mpu_lab.labkit.megatron_core and
launch/megatron_core_side_by_side.py). Skipped where megatron-core is not installed (it is
optional: `pip install megatron-core`).

The reference here is Megatron-core itself: its RankGenerator for the rank groups (pure), and
its ColumnParallelLinear / RowParallelLinear / mappings on a real 4-rank gloo world (one job).
"""
import importlib
import logging

import pytest
import torch

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


@pytest.mark.slow
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


def test_the_no_cuda_runtime_notice_filter_drops_only_that_notice():
    keep = mc.NoCudaRuntimeNotice().filter
    record = logging.LogRecord("torch.utils.cpp_extension", logging.WARNING, __file__, 1,
                               "No CUDA runtime is found, using CUDA_HOME='%s'", ("/usr",), None)
    assert not keep(record)
    record.msg, record.args = "Error checking compiler version for %s", ("c++",)
    assert keep(record)


@pytest.mark.skipif(torch.version.cuda is None or torch.cuda.is_available(),
                    reason="only a CUDA build of torch with no GPU logs the notice")
def test_the_kit_imports_megatron_core_without_the_no_cuda_runtime_notice(tmp_path, monkeypatch):
    """A CUDA build of torch on a machine with no GPU (what a fresh install gets on a laptop,
    and CI's newest-torch leg) logs "No CUDA runtime is found" when torch.utils.cpp_extension
    is imported, which megatron-core does; the kit imports it inside
    ``without_cuda_runtime_notice`` and lab 01 stays clean. Shown by re-executing
    cpp_extension (``importlib.reload``) with CUDA_HOME at an existing folder: bare, and
    inside the kit's guard."""
    import torch.utils.cpp_extension as cpp

    seen = []
    catch = logging.Handler()
    catch.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("torch.utils.cpp_extension")
    log.addHandler(catch)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    try:
        importlib.reload(cpp)
        assert any(m.startswith("No CUDA runtime is found") for m in seen), seen
        seen.clear()
        with mc.without_cuda_runtime_notice():
            importlib.reload(cpp)
        assert not any(m.startswith("No CUDA runtime is found") for m in seen), seen
    finally:
        log.removeHandler(catch)
        monkeypatch.undo()
        with mc.without_cuda_runtime_notice():
            importlib.reload(cpp)   # back to this machine's CUDA_HOME
