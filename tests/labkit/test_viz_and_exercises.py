"""mpu_lab.labkit.viz (pictures, text views) and mpu_lab.labkit.exercises (the labs' checks), no processes."""
import pathlib

import matplotlib
import numpy as np
import pytest
from matplotlib.figure import Figure

from mpu_lab.core import parallel_state
from mpu_lab.labkit import exercises, viz
from mpu_lab.labkit.exercises import Verdict

REPO = pathlib.Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- rank groups
def test_tp_groups_stay_in_their_box_in_megatron_order_and_leave_it_when_tp_is_slowest():
    good = parallel_state.generate_rank_groups(16, 2, 4)
    assert viz.groups_crossing_nodes(good["tp"], 8) == []
    assert viz.groups_crossing_nodes(good["pp"], 8) == good["pp"]        # stages span the boxes
    bad = parallel_state.generate_rank_groups(16, 2, 4, order="pp-dp-tp")
    assert viz.groups_crossing_nodes(bad["tp"], 8) == bad["tp"] == [[i, i + 8] for i in range(8)]


def test_six_gpu_nodes_split_two_of_six_tp4_groups():
    groups = parallel_state.generate_rank_groups(24, 4, 2)
    assert viz.groups_crossing_nodes(groups["tp"], 6) == [[4, 5, 6, 7], [16, 17, 18, 19]]
    with pytest.raises(ValueError, match="gpus_per_node"):
        viz.groups_crossing_nodes(groups["tp"], 0)


def test_format_groups_prints_the_walkthrough_listing():
    text = viz.format_groups(parallel_state.generate_rank_groups(16, 2, 4), ["dp", "tp", "pp"])
    assert text.splitlines() == [
        " 8 data_parallel groups:",
        " [g0, g2], [g1, g3], [g4, g6], [g5, g7], [g8, g10], [g9, g11], [g12, g14], [g13, g15]",
        " 8 tensor model-parallel groups:",
        " [g0, g1], [g2, g3], [g4, g5], [g6, g7], [g8, g9], [g10, g11], [g12, g13], [g14, g15]",
        " 4 pipeline model-parallel groups:",
        " [g0, g4, g8, g12], [g1, g5, g9, g13], [g2, g6, g10, g14], [g3, g7, g11, g15]",
    ]


def test_show_rank_groups_prints_the_reason_for_a_bad_configuration_instead_of_raising(capsys):
    assert viz.show_rank_groups(world_size=12, tp=8, pp=1, draw=False) is None
    out = capsys.readouterr().out
    assert out.startswith("not a valid configuration: world_size 12 is not divisible")


def test_show_rank_groups_lists_the_families_and_crossings(capsys):
    viz.show_rank_groups(world_size=16, tp=2, pp=4, draw=False)
    out = capsys.readouterr().out
    assert "n = 16 = t*p*c*d = 2*4*1*2" in out
    assert " 2 model-parallel groups:" in out
    assert " pp groups crossing a node boundary: 4 of 4" in out


def test_group_figure_has_one_panel_per_family_and_hatches_only_crossing_gpus():
    fig = viz.plot_group_families(16, tp=2, pp=4, families=("tp", "pp"))
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    tp_ax, pp_ax = fig.axes
    squares = lambda ax: [p for p in ax.patches if isinstance(p, matplotlib.patches.Rectangle)
                          and not isinstance(p, matplotlib.patches.FancyBboxPatch)]
    assert len(squares(tp_ax)) == 16 and not any(p.get_hatch() for p in squares(tp_ax))
    assert len(squares(pp_ax)) == 16 and all(p.get_hatch() for p in squares(pp_ax))


def test_interactive_view_builds_widgets_and_returns_none():
    pytest.importorskip("ipywidgets")
    assert viz.interactive_rank_groups(world_size=8, tp=2, pp=2) is None


# --------------------------------------------------------------------------- splits
def test_shard_shapes_split_by_the_parts_asked_for():
    assert viz.shard_shapes("column", 1024, 512, 2) == [(1024, 256)] * 2
    assert viz.shard_shapes("column", 1024, 512, 16) == [(1024, 32)] * 16    # the walkthrough's slip
    assert viz.shard_shapes("row", 1024, 512, 2) == [(512, 512)] * 2
    assert viz.shard_shapes("row", 1024, 512, 16) == [(64, 512)] * 16
    with pytest.raises(ValueError, match="not divisible into 3"):
        viz.shard_shapes("column", 1024, 512, 3)
    with pytest.raises(ValueError, match="kind"):
        viz.shard_shapes("diagonal", 4, 4, 2)


def test_print_shard_shapes_uses_the_walkthrough_format(capsys):
    viz.print_shard_shapes("column", 1024, 512, 2)
    assert capsys.readouterr().out.splitlines() == [
        "A = [", "A0= torch.Size([1024, 256]), A1= torch.Size([1024, 256])", " ]", "2 pieces"]


def test_strided_owners_deal_pieces_round_robin():
    assert viz.strided_owners(12, tp=2, stride=3) == [0, 0, 1, 1] * 3
    assert viz.strided_owners(4, tp=2, stride=1) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="tp\\*stride = 2\\*3"):
        viz.strided_owners(8, tp=2, stride=3)


@pytest.mark.parametrize("make", [
    lambda: viz.plot_column_split(1024, 512, 2),
    lambda: viz.plot_column_split(1024, 1536, 4, stride=3),
    lambda: viz.plot_row_split(1024, 512, 4),
    lambda: viz.plot_fg(4),
])
def test_split_and_fg_diagrams_build(make):
    fig = make()
    assert isinstance(fig, Figure) and fig.axes


# --------------------------------------------------------------------------- collectives
# Megatron's default order puts tensor-parallel ranks next to each other: the TP groups are
# blocks of consecutive ranks. Written out by hand (not from parallel_state), per world size.
TP_GROUPS = {
    8: {4: [[0, 1, 2, 3], [4, 5, 6, 7]],
        2: [[0, 1], [2, 3], [4, 5], [6, 7]]},
    16: {4: [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
         2: [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]},
}
# Per rank, what Megatron's unit tests assert (tests/unit_tests/tensor_parallel/), at the
# layouts of launch/collectives.py: broadcast_data and gather_split at tp=2 (pp=4), the others
# at tp=4 (pp=2).
COPY_SUMS = {8: [6, 6, 6, 6, 22, 22, 22, 22],                          # 0+1+2+3, 4+5+6+7
             16: [6] * 4 + [22] * 4 + [38] * 4 + [54] * 4}
BROADCAST_SRC = {8: [0, 0, 2, 2, 4, 4, 6, 6],
                 16: [0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14]}
TP4_POSITION = {8: [0, 1, 2, 3, 0, 1, 2, 3], 16: [0, 1, 2, 3] * 4}     # rank % 4


def megatron_results(world=8):
    """Per-rank reports shaped like launch/collectives.py's, holding Megatron's values."""
    results = []
    for rank in range(world):
        (tp4,) = [g for g in TP_GROUPS[world][4] if rank in g]
        (tp2,) = [g for g in TP_GROUPS[world][2] if rank in g]
        pos = TP4_POSITION[world][rank]
        results.append({"rank": rank, "tests": {
            "broadcast": {"src": BROADCAST_SRC[world][rank], "means": [0.0, 1.0]},
            "copy": {"tp_group": tp4, "value": float(COPY_SUMS[world][rank])},
            "reduce": {"tp_group": tp4, "value": float(COPY_SUMS[world][rank])},
            "scatter": {"column": pos, "shape": [8, 1]},
            "gather": {"blocks": tp4},
            # gather_split_1d_tensor of (2, 4) tensors filled with their rank: 8 of each
            "gather_split": {"output": [float(tp2[0])] * 8 + [float(tp2[1])] * 8},
            "sequence": {"rows": [2 * pos, 2 * pos + 2], "reduce_scatter": 4.0 * pos},
        }})
    return results


def test_the_hand_written_megatron_values_hold_for_rank_5_of_8():
    """Spot check of the table above against Megatron's test for one rank, in full."""
    r5 = megatron_results()[5]["tests"]
    assert r5["copy"] == {"tp_group": [4, 5, 6, 7], "value": 22.0}
    assert r5["broadcast"]["src"] == 4 and r5["scatter"]["column"] == 1
    assert r5["gather_split"]["output"] == [4.0] * 8 + [5.0] * 8
    assert r5["sequence"] == {"rows": [2, 4], "reduce_scatter": 4.0}


def test_megatron_expectations_are_the_6_and_22(capsys):
    assert exercises.group_sum_of_ranks(2, 8, tp=4, pp=2) == 6
    assert exercises.group_sum_of_ranks(5, 8, tp=4, pp=2) == 22
    assert exercises.check_megatron_expectations(megatron_results())
    out = capsys.readouterr().out
    assert "copy         (tp=4, pp=2) as Megatron expects: ranks 0-3 hold 6, ranks 4-7 hold 22" in out
    assert out.strip().endswith("Right: all 8 ranks agree with Megatron's unit tests.")


def test_megatron_expectations_catch_a_wrong_value(capsys):
    results = megatron_results()
    results[6]["tests"]["copy"]["value"] = 6.0
    assert not exercises.check_megatron_expectations(results)
    assert "copy         (tp=4, pp=2) DIFFERS from Megatron" in capsys.readouterr().out


def test_megatron_expectations_scale_to_16_ranks():
    assert exercises.check_megatron_expectations(megatron_results(16))


@pytest.mark.parametrize("name", sorted(viz.COLLECTIVE_LAYOUTS))
def test_collective_pictures_have_a_before_and_after_panel_per_rank(name):
    views = viz.collective_views(name, megatron_results())
    assert len(views) == (3 if name == "sequence" else 1)
    for title, before, after, groups in views:
        assert len(before) == len(after) == 8 and groups
        fig = viz.plot_collective(title, before, after, groups)
        assert len(fig.axes) == 16


def test_collective_views_rebuild_the_inputs_and_read_the_outputs():
    (_, before, after, _), = viz.collective_views("copy", megatron_results())
    assert before == [[float(r)] for r in range(8)]
    assert after == [[6.0]] * 4 + [[22.0]] * 4
    (_, before, _, _), = viz.collective_views("broadcast", megatron_results())
    assert before[0] == [0.0, 1.0] and before[1] is None     # only each group's first rank reads


def test_plot_collective_rejects_mismatched_lists():
    with pytest.raises(ValueError, match="2 'before' tensors but 1 'after'"):
        viz.plot_collective("x", [[1], [2]], [[1]])


def test_print_test_log_prints_one_section():
    lines = ["== copy (tp=4, pp=2) ==", "rank 0: 6", "copy: passed on all 8 ranks",
             "== reduce (tp=4, pp=2) ==", "rank 0: 6", "reduce: passed on all 8 ranks"]
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        viz.print_test_log(lines, "copy")
        viz.print_test_log(lines, "gather")
    assert buf.getvalue().splitlines() == lines[:3] + ["(no log section starting with '== gather ')"]


# --------------------------------------------------------------------------- figures/
def test_saved_pngs_are_byte_stable_and_carry_no_software_stamp(tmp_path):
    first = viz.save_figures(tmp_path / "a", ["fg_mlp_tp2.png"])[0].read_bytes()
    second = viz.save_figures(tmp_path / "b", ["fg_mlp_tp2.png"])[0].read_bytes()
    assert first == second
    assert b"Software" not in first and b"matplotlib" not in first.lower()


def test_committed_figures_match_the_figure_code(tmp_path):
    """figures/ is generated: `python -m mpu_lab.labkit.notebooks figures` after changing viz."""
    import matplotlib.image as mpimg
    names = sorted(viz.figure_catalog())
    assert sorted(p.name for p in (REPO / "figures").glob("*.png")) == names
    for path in viz.save_figures(tmp_path, names):
        fresh, committed = mpimg.imread(path), mpimg.imread(REPO / "figures" / path.name)
        assert fresh.shape == committed.shape and np.abs(fresh - committed).max() < 0.02, path.name


def test_unknown_figure_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown figure"):
        viz.save_figures(tmp_path, ["nope.png"])


# --------------------------------------------------------------------------- exercises
@pytest.mark.parametrize("check,right,wrong", [
    (lambda a: exercises.check_group_of_rank(a, 6, "dp", 32, 4, 2), [2, 6, 10, 14], [2, 6, 10]),
    (lambda a: exercises.check_crossing_count(a, "tp", 24, 4, 2, gpus_per_node=6), 2, 0),
    (lambda a: exercises.check_column_weight_shape(a, 1024, 768, 4), (192, 1024), (1024, 192)),
    (lambda a: exercises.check_strided_rows(a, 1, 24, 4, 3), [2, 3, 10, 11, 18, 19], [6, 7, 8, 9, 10, 11]),
    (lambda a: exercises.check_row_weight_shape(a, 1024, 512, 4), (512, 256), (256, 512)),
    (lambda a: exercises.check_mlp_all_reduces(a), (1, 1), (2, 2)),
    (lambda a: exercises.check_all_reduce_of_ranks(a, 5, 8, 2, 4), 9, 22),
    (lambda a: exercises.check_gather_split(a, 3, 8, 4, 2), [float(v) for v in range(4) for _ in range(8)],
     [3.0] * 32),
    (lambda a: exercises.check_bubble_share(a, 4, 8), 3 / 11, 3 / 8),
    (lambda a: exercises.check_bubble_share(a, 4, 8, v=2), 3 / 19, 3 / 11),
    (lambda a: exercises.check_peak_in_flight(a, "1f1b", 4, 8), 4, 8),
    (lambda a: exercises.check_peak_in_flight(a, "gpipe", 4, 8), 8, 4),
    (lambda a: exercises.check_peak_in_flight(a, "1f1b", 4, 8, stage=3), 1, 4),
])
def test_each_check_says_right_wrong_or_not_yet(capsys, check, right, wrong):
    assert check(right) and capsys.readouterr().out.startswith("Right:")
    assert not check(wrong) and capsys.readouterr().out.startswith("Not yet:")
    assert not check(None) and capsys.readouterr().out.startswith("No answer yet:")


def test_checks_accept_tensors_and_sizes_and_explain_transposed_shapes(capsys):
    import torch
    assert exercises.check_column_weight_shape(torch.Size([256, 1024]), 1024, 512, 2)
    assert exercises.check_gather_split(torch.tensor([0.0] * 8 + [1.0] * 8), 1, 8, 2, 4)
    capsys.readouterr()
    exercises.check_column_weight_shape([1024, 256], 1024, 512, 2)
    assert "F.linear computes X W^T" in capsys.readouterr().out
    exercises.check_group_of_rank([14, 10, 6, 2], 6, "dp", 32, 4, 2)
    assert "the right ranks, but Megatron lists them as [2, 6, 10, 14]" in capsys.readouterr().out


def test_checks_reject_junk_without_raising(capsys):
    assert not exercises.check_crossing_count("two", "tp", 24, 4, 2, gpus_per_node=6)
    assert not exercises.check_column_weight_shape("256x1024", 1024, 512, 2)
    assert not exercises.check_gather_split(3, 1, 8, 2, 4)
    assert not exercises.check_crossing_count(True, "tp", 16, 2, 4)


def test_verdict_is_truthy_compares_with_bool_and_shows_nothing_in_a_notebook():
    assert Verdict(True) == True and Verdict(False) == False  # noqa: E712
    assert bool(Verdict(True)) and not Verdict(False)
    assert repr(Verdict(True)) == "Verdict(True)"
    assert Verdict(True)._ipython_display_() is None
    assert exercises.summarize([Verdict(True), Verdict(False), True]) == "2 of 3 right"
