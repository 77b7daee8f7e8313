"""Lab 11's pictures (mpu_lab.labkit.pipeline_parallel.viz): the pair of Gantt charts, measured above
predicted, each with its own title and the idle share of its own records."""
from mpu_lab.labkit.pipeline_parallel.viz import plot_gantt_pair
from mpu_lab.perf.pipeline_simulation import simulate


def test_gantt_pair_draws_two_charts_with_their_own_idle_shares():
    top = simulate("1f1b", 2, 1).records           # idle share 1/2
    bottom = simulate("1f1b", 4, 8).records        # idle share 3/11
    fig = plot_gantt_pair(top, bottom, "measured", "predicted")
    upper, lower = fig.axes[:2]
    assert upper.get_title() == "measured — idle share 50.0%"
    assert lower.get_title() == "predicted — idle share 27.3%"
    assert [t.get_text() for t in lower.get_yticklabels()] == [f"stage {k}" for k in (3, 2, 1, 0)]


def _labels_by_row(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig).draw()
    rows = {}
    for text in fig.axes[0].texts:
        box = text.get_window_extent()
        rows.setdefault(round(text.get_position()[1]), []).append((box.x0, box.x1))
    return rows


def test_gantt_labels_every_box_that_has_room_and_never_overprints():
    from mpu_lab.labkit.pipeline_parallel.viz import plot_gantt
    few = _labels_by_row(plot_gantt(simulate("1f1b", 4, 8).records))
    assert sum(len(r) for r in few.values()) == 4 * 2 * 8          # every F and B box of 4 stages
    # m = 32: the backwards (twice a forward's width) have room for two digits; the old rule
    # (a box wider than 1/60 of the span) labelled none of them
    assert sum(len(r) for r in _labels_by_row(plot_gantt(simulate("1f1b", 4, 32).records)).values())
    for m in (32, 64):                                               # two-digit labels, narrow boxes
        for spans in _labels_by_row(plot_gantt(simulate("1f1b", 4, m).records)).values():
            spans.sort()
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), m   # drawn extents apart


def test_a_shared_time_axis_fits_the_labels_to_it_and_never_overprints():
    # lab 15's pair: one micro-batch, then eight, on one axis; the labels of the short chart
    # were once placed for its own axis and overprinted ("0123456 7") when the axis grew
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    import pytest
    bad, remedy = simulate("1f1b", 8, 1).records, simulate("1f1b", 8, 8).records
    fig = plot_gantt_pair(bad, remedy, "bad", "remedy", time_unit="units", same_time_axis=True)
    assert fig.axes[0].get_xlim() == fig.axes[1].get_xlim()
    FigureCanvasAgg(fig).draw()
    rows = {}
    for text in fig.axes[1].texts:
        box = text.get_window_extent()
        rows.setdefault(round(text.get_position()[1]), []).append((box.x0, box.x1))
    for spans in rows.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    from mpu_lab.labkit.pipeline_parallel.viz import plot_gantt
    with pytest.raises(ValueError, match="would cut the chart"):
        plot_gantt(remedy, time_limit=1.0)
