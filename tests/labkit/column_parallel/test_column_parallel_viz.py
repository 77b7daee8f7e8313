"""Labs 06-07's column and row splits and f / g (mpu_lab.labkit.column_parallel.viz), no processes."""
import pytest
from matplotlib.figure import Figure

from mpu_lab.labkit.column_parallel import viz


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


def _option_reports():
    """Two ranks' linear_options.py reports, written by hand: a fused layer of 3 parts of 512
    rows at t = 2 keeps rows [256 r, 256 r + 255] of each part on rank r."""
    def case(rank, **extra):
        return dict(dict(layer="column", name="gather_output=True", output_shape=[4, 512],
                         forward={"all_gather": 1}, backward={"all_reduce": 1},
                         matches_dense=True), **extra)
    return [{"rank": r, "tp": 2, "cases": [
        case(r),
        case(r, name="stride=3 (fused)", output_shape=[4, 768], forward={},
             row_blocks=[[256 * r + 512 * k, 256 * r + 512 * k + 255] for k in range(3)]),
        case(r, layer="mlp", name="column(gather_output=False) -> GeLU -> row(input_is_parallel=True)",
             forward={"all_reduce": 1}, matches_dense=(r == 0))]} for r in range(2)]


def test_options_are_one_table_where_ranks_agree_and_a_line_per_rank_where_not():
    lines = viz.format_options(_option_reports()).splitlines()
    assert max(len(line) for line in lines) <= 100
    table = {line.split()[0]: line.split() for line in lines[3:6]}
    assert table["gather_output=True"][1:] == ["[4,", "512]", "1", "all_gather", "1", "all_reduce", "True"]
    assert table["mlp"][-1] == "False"                          # rank 1 did not match
    assert "stride=3 (fused), master rows kept on rank 1: 256-511 768-1023 1280-1535" in lines
    assert "mlp: column(gather_output=False) -> GeLU -> row(input_is_parallel=True)" in lines
