"""mpu_lab next to the real Megatron-core (mpu_lab.megatron_reference.runtime and
launch/megatron_core_side_by_side.py), with whichever release this Python has (0.16.x below
Python 3.12, 0.19+ from 3.12 on): the side-by-side tests are skipped where megatron-core cannot
be imported (it is optional: `pip install megatron-core`).

The reference here is Megatron-core itself: its RankGenerator for the rank groups (pure), and
its ColumnParallelLinear / RowParallelLinear / mappings on a real 4-rank gloo world (one job).
"""
import importlib
import importlib.metadata
import importlib.util
import logging
import pathlib
import sys

import pytest
import torch
from packaging.requirements import Requirement

from documented import COMMANDS, script_and_flags
from mpu_lab import launcher
from mpu_lab.megatron_reference import runtime as mc, layers as megatron_layers
from mpu_lab.labkit.rank_groups import megatron_core as rank_groups_megatron_core
from mpu_lab.labkit.column_parallel import megatron_core as column_parallel_megatron_core

TOL = 1e-6   # fp32
needs_megatron = pytest.mark.skipif(not mc.available(), reason=mc.missing() or "")


@needs_megatron
@pytest.mark.parametrize("world,tp,pp,cp,order", [
    (16, 2, 4, 1, "tp-cp-dp-pp"),    # the MPU walkthrough's first example
    (16, 4, 2, 1, "tp-cp-dp-pp"),    # and its second
    (16, 2, 2, 2, "tp-cp-dp-pp"),    # context parallel: dp-cp, tp-cp, tp-dp-cp differ from dp...
    (16, 2, 2, 2, "tp-dp-cp-pp"),    # ... and another order of the same sizes
])
def test_rank_groups_equal_megatron_core_rank_generator(world, tp, pp, cp, order):
    table = rank_groups_megatron_core.rank_groups_side_by_side(world, tp, pp, cp=cp, order=order)
    unequal = {k: f for k, f in table["families"].items() if not f["equal"]}
    assert unequal == {}
    assert table["all_equal"]
    assert set(table["families"]) == set(rank_groups_megatron_core.TOKENS)


@needs_megatron
def test_walkthrough_groups_read_the_same_in_both():
    fams = rank_groups_megatron_core.rank_groups_side_by_side(16, 2, 4)["families"]
    assert fams["tp"]["megatron_core"][:3] == [[0, 1], [2, 3], [4, 5]]
    assert fams["pp"]["megatron_core"][0] == [0, 4, 8, 12]
    assert fams["dp"]["megatron_core"][:2] == [[0, 2], [1, 3]]
    assert fams["embedding"]["megatron_core"][0] == [0, 12]
    fams = rank_groups_megatron_core.rank_groups_side_by_side(16, 4, 2)["families"]
    assert fams["tp"]["megatron_core"][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert fams["pp"]["megatron_core"][0] == [0, 8]
    fams = rank_groups_megatron_core.rank_groups_side_by_side(16, 2, 2, cp=2)["families"]
    assert fams["cp"]["megatron_core"][0] == [0, 2]
    assert fams["dp-cp"]["megatron_core"][0] == [0, 2, 4, 6]
    assert "tp-dp-cp" in rank_groups_megatron_core.format_rank_groups(rank_groups_megatron_core.rank_groups_side_by_side(16, 2, 2, cp=2))


@needs_megatron
@pytest.mark.slow
def test_layers_and_mappings_equal_megatron_core_on_four_ranks():
    """One job: the command megatron_core_side_by_side.py's docstring shows (tests/documented.py,
    ``--what all`` on its 4 ranks) with ``--tp 2 --sequence-parallel`` after it: TP=2 (dp=2),
    plain and sequence-parallel layers, all mappings."""
    script, flags, nproc = script_and_flags(COMMANDS["megatron_core_side_by_side.py:1"])
    assert script == "megatron_core_side_by_side.py" and flags == ["--what", "all"] and nproc == 4
    job = launcher.run(script, flags + ["--tp", "2", "--sequence-parallel"], nproc=nproc)
    results = job.results
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert [r["column"]["tp_rank"] for r in results] == [0, 1, 0, 1]
    for r in results:
        assert r["groups_equal"], r
        for kind in megatron_layers.LINEAR_KINDS:
            c = r[kind]
            assert c["same_init"], (kind, c)   # Megatron-core's own CPU init: the same shard
            for key in ("output", "input_grad", "weight_grad", "bias_grad"):
                assert c[key] <= TOL, (r["rank"], kind, key, c)
        assert set(r["mappings"]) == set(megatron_layers.MAPPINGS)
        for name, m in r["mappings"].items():
            assert m["forward"] <= TOL and m["backward"] <= TOL, (r["rank"], name, m)
    table = column_parallel_megatron_core.format_results(results)
    assert "column parallel linear + sequence parallel" in table
    assert "reduce_scatter_sp" in table
    assert column_parallel_megatron_core.format_results(results, what="row").count("row parallel linear") == 2


def test_without_megatron_core_the_kit_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert not mc.available()
    with pytest.raises(ImportError, match="pip install megatron-core"):
        rank_groups_megatron_core.rank_groups_side_by_side(8, 2, 2)
    skipped = [{"rank": 0, "skipped": mc.INSTALL_HINT}, {"rank": 1, "skipped": mc.INSTALL_HINT}]
    assert column_parallel_megatron_core.format_results(skipped) == mc.INSTALL_HINT
    assert "optional" in mc.INSTALL_HINT


@pytest.mark.parametrize("release,needs", [
    ("0.16.1", False), ("0.16.0", False), ("0.17.0rc1", True), ("0.19.2", True),
    ("1.0.0", True), (None, False)])
def test_megatron_core_needs_triton_from_0_17_on(release, needs):
    assert mc.needs_triton(release) is needs


def test_megatron_core_0_17_on_without_triton_says_how_to_add_it(monkeypatch):
    """0.19's `import megatron.core` imports triton, which torch's CPU build does not bring:
    the kit says so instead of failing in the import."""
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name == "triton" else object())
    monkeypatch.setattr(mc, "version", lambda: "0.19.2")
    assert not mc.available()
    assert "pip install triton" in mc.missing() and "0.19.2" in mc.missing()
    with pytest.raises(ImportError, match="pip install triton"):
        rank_groups_megatron_core.rank_groups_side_by_side(8, 2, 2)
    monkeypatch.setattr(mc, "version", lambda: "0.16.1")   # 0.16 imports without triton
    assert mc.available() and mc.missing() is None


def test_requirements_give_each_python_the_newest_megatron_core_it_can_install():
    """0.17 on need Python >= 3.12 (cp312+ wheels only): requirements.txt gives 3.10 and 3.11
    the 0.16 series and 3.12+ 0.19 or newer, with triton, which 0.17+ imports."""
    requirements = pathlib.Path(__file__).resolve().parents[2] / "requirements.txt"
    lines = requirements.read_text().splitlines()
    specs = [line.split("#", 1)[0].strip() for line in lines if not line.startswith("-")]
    reqs = [Requirement(spec) for spec in specs if spec]
    linux = {"platform_system": "Linux", "platform_machine": "x86_64"}

    def pick(name, python):
        return [str(r.specifier) for r in reqs if r.name == name
                and r.marker.evaluate({**linux, "python_version": python})]

    for python in ("3.10", "3.11"):
        assert pick("megatron-core", python) == ["<0.17,>=0.16"] and pick("triton", python) == []
    for python in ("3.12", "3.13"):
        assert pick("megatron-core", python) == [">=0.19"] and pick("triton", python) == [""]


@needs_megatron
def test_this_python_has_the_megatron_core_series_requirements_give_it():
    major, minor = (int(n) for n in mc.version().split(".")[:2])
    if sys.version_info >= (3, 12):
        assert (major, minor) >= (0, 19), mc.version()
    else:
        assert (major, minor) == (0, 16), mc.version()


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
