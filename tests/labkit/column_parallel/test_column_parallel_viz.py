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
