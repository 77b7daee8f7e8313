"""Lab 09's pictures (mpu_lab.labkit.pipeline_parallel.viz): the pair of Gantt charts, measured above
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
