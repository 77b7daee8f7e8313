"""Lab 01's pictures and text views (mpu_lab.labkit.rank_groups.viz), no processes."""
import matplotlib
import pytest
from matplotlib.figure import Figure

from mpu_lab.core import parallel_state
from mpu_lab.labkit.rank_groups import viz


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
