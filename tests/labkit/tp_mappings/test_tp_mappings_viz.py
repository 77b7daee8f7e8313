"""Lab 08: Megatron's collective tests predicted (mpu_lab.labkit.tp_mappings.exercises) and drawn
(mpu_lab.labkit.tp_mappings.viz), no processes."""
import pytest

from mpu_lab.labkit.tp_mappings import exercises, viz
from mpu_lab.megatron_reference import collective_layouts as megatron_collective_layouts


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


@pytest.mark.parametrize("name", sorted(megatron_collective_layouts.COLLECTIVE_LAYOUTS))
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


def test_print_test_table_prints_one_row_per_set_of_ranks_that_agree(capsys):
    viz.print_test_table("copy", megatron_results(), ["copy: passed on all 8 ranks"])
    assert capsys.readouterr().out.splitlines() == [
        "copy (tp=4, pp=2): rank r holds [r]; f's backward",
        "ranks       after (the same on every rank of the row)",
        "0-3         [6], the sum over the group",           # 0+1+2+3, Megatron's test
        "4-7         [22], the sum over the group",          # 4+5+6+7
        "passed on all 8 ranks"]
    viz.print_test_table("scatter", megatron_results(), [])
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "0, 4        column 0: [0, 4, 8, 12, 16, 20, 24, 28]"   # x[i, 0] = 4 i
    assert out[-1].startswith("the log holds no 'passed' line")


@pytest.mark.parametrize("name", sorted(megatron_collective_layouts.COLLECTIVE_LAYOUTS))
def test_print_test_table_lines_fit_100_characters(name, capsys):
    viz.print_test_table(name, megatron_results(), [f"{name}: passed on all 8 ranks"])
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 100


@pytest.mark.parametrize("n", [2, 4, 8])
def test_collective_captions_do_not_reach_the_next_panel(n):
    """Lab 02's pictures captioned "1x4: 0 x1, 10 x1, 20 x1, 30 x1" under panels narrower than
    that: each caption's drawn extent must end before the next panel's caption starts."""
    before = [[float(r)] for r in range(n)]
    after = [[10.0 * r for r in range(n)] for _ in range(n)]
    fig = viz.plot_collective("all-gather: piece (before), g (after)", before, after,
                              [list(range(n))])
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    for row in (0, 1):
        boxes = [ax.xaxis.label.get_window_extent(renderer) for ax in fig.axes[row * n:(row + 1) * n]]
        assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:])), [b.bounds for b in boxes]
