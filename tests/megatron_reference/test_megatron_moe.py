"""Megatron-core's MoELayer against mpu_lab's (mpu_lab.megatron_reference.moe and
launch/megatron_core_moe.py), with whichever release this Python has (0.16.x below Python
3.12, 0.19+ from 3.12 on); skipped where megatron-core cannot be imported.

The reference is Megatron-core's own layer, loaded with mpu_lab's state dict by parameter name;
its output with its own initial weights must differ (so equal outputs are not vacuous).
"""
import pytest

from documented import COMMANDS, script_and_flags
from mpu_lab.megatron_reference import runtime as mc
from mpu_lab.megatron_reference import moe as mcm
from mpu_lab.labkit.mixture_of_experts import megatron_core
from mpu_lab.labkit.rank_groups import megatron_core as rank_groups_megatron_core

needs_megatron = pytest.mark.skipif(not mc.available(), reason=mc.missing() or "")


def test_case_names_parse_and_bad_ones_are_refused_naming_the_values():
    assert mcm.parse_case("ep2/alltoall/top2") == mcm.Case(1, 2, 1, "alltoall", 2)
    # etp defaults to tp, as Megatron's expert_tensor_parallel_size=None
    assert mcm.parse_case("tp2-ep2/allgather/top1") == mcm.Case(2, 2, 2, "allgather", 1)
    assert mcm.parse_case("tp2-ep2-etp1/alltoall/top1").name == "tp2-ep2/alltoall/top1"
    with pytest.raises(ValueError, match="'ep2/a2a/top2' is not"):
        mcm.parse_case("ep2/a2a/top2")
    with pytest.raises(ValueError, match="etp > 1 does not run on gloo"):
        mcm.parse_case("tp2-ep2/alltoall/top1")
    with pytest.raises(ValueError, match=r"top5 needs 1..4"):
        mcm.parse_case("ep2/alltoall/top5")
    with pytest.raises(ValueError, match="etp x ep = 4 does not divide the 6 ranks"):
        mcm.parse_case("tp2-ep2/allgather/top1", world_size=6)


def test_without_megatron_core_the_run_is_skipped_with_the_install_hint(monkeypatch):
    monkeypatch.setattr(mc, "missing", lambda: mc.INSTALL_HINT)
    result = megatron_core.run_side_by_side(["ep2/alltoall/top2"])
    assert result == {"skipped": mc.INSTALL_HINT}
    assert megatron_core.format_results(result) == mc.INSTALL_HINT
    assert not megatron_core.all_equal(result)


@needs_megatron
@pytest.mark.slow
def test_moe_layer_equals_megatron_cores_on_four_cpu_ranks():
    """The command megatron_core_moe.py's docstring shows (tests/documented.py): its cases on
    its 4 ranks, and in the same job every other case that runs there, ten in all:
    tp x ep x etp = 1x2x1, 1x4x1 and 2x2x2, both dispatchers (all-gather only at etp 2, where
    gloo refuses Megatron-core's uneven list all-gather), top-1 and top-2. Megatron-core's
    MoELayer loads mpu_lab's state dict with no key missing or left over and gives the same
    output and gradients (fp32, the same ops: within 1e-6)."""
    script, flags, nproc = script_and_flags(COMMANDS["megatron_core_moe.py:1"])
    assert script == "megatron_core_moe.py" and flags[0] == "--cases" and nproc == 4
    every = [f"{layout}/{dispatcher}/top{k}" for layout, dispatchers in
             (("ep2", ("alltoall", "allgather")), ("ep4", ("alltoall", "allgather")),
              ("tp2-ep2-etp2", ("allgather",)))
             for dispatcher in dispatchers for k in (1, 2)]
    documented = [mcm.parse_case(c).name for c in flags[1:]]
    assert len(every) == 10 and set(documented) <= {mcm.parse_case(c).name for c in every}
    cases = flags[1:] + [c for c in every if mcm.parse_case(c).name not in documented]
    result = megatron_core.run_side_by_side(cases, nproc=nproc)
    assert result["version"] == mc.version()
    assert [r["rank"] for r in result["results"]] == [0, 1, 2, 3]
    for name in cases:
        w = megatron_core.worst(result, name)
        assert w["same_names"], (name, w)
        bad = {k: w[k] for k in ("out", "dx", "router", "experts") if not w[k] <= 1e-6}
        assert not bad, (name, bad)
        assert w["own_init_out"] > 1e-3, (name, w)     # not vacuous: the check can fail
    assert megatron_core.all_equal(result)
    table = megatron_core.format_results(result)
    assert table.startswith(f"megatron-core {mc.version()} vs mpu_lab, 4 CPU ranks")
    assert table.count("differs") == len(cases) and "NO" not in table


@needs_megatron
def test_expert_groups_equal_megatron_cores_expert_rank_generator_over_a_sweep():
    checked = 0
    for world in (8, 16, 32):
        for tp in (1, 2, 4):
            for pp in (1, 2):
                for ep in (1, 2, 4, 8):
                    for etp in (None, 1, 2):
                        e = tp if etp is None else etp
                        if world % (tp * pp) or world % (e * ep * pp):
                            continue
                        table = rank_groups_megatron_core.expert_groups_side_by_side(world, tp, pp, ep, etp)
                        assert table["all_equal"], (world, tp, pp, ep, etp, table)
                        assert table["edp"] == world // (e * ep * pp)
                        checked += 1
    assert checked > 60


def test_groups_summary_says_how_to_install_where_megatron_core_is_missing(monkeypatch):
    monkeypatch.setattr(mc, "missing", lambda: mc.INSTALL_HINT)
    assert rank_groups_megatron_core.groups_summary(16, 2, 2, ep=2) == mc.INSTALL_HINT


@needs_megatron
def test_groups_summary_counts_the_equal_families():
    line = rank_groups_megatron_core.groups_summary(16, 2, 2, ep=2)
    assert line.startswith("n=16, t=2, p=2: 11 of 11 dense families equal Megatron-core's (tp,")
    assert line.endswith("ep=2: 5 of 5 expert families (ep, expert-tp, expert-tp-ep, "
                         "expert-tp-ep-pp, expert-dp)")
    assert "expert" not in rank_groups_megatron_core.groups_summary(16, 2, 4)
