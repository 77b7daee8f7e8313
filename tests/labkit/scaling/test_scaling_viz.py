"""mpu_lab.labkit.scaling.viz: the roofline draws one line per bandwidth of the cluster, bending at
its ridge, and one marker per dimension at its intensity."""
import pytest

from mpu_lab.labkit.scaling.viz import plot_roofline
from mpu_lab.perf import back_of_envelope as be
from mpu_lab.perf.cost_model import DGX_H100


def test_roofline_has_a_line_per_link_and_a_marker_per_case():
    cases = [be.tensor_parallel(12288, 2048, 8), be.context_parallel(12288, 32768, 1, 4, 8),
             be.tensor_parallel(64, 8, 1)]                   # t = 1: nothing sent, no marker
    ax = plot_roofline(cases, DGX_H100).axes[0]
    lines = [ln for ln in ax.get_lines() if ln.get_label().startswith(("HBM", "NVLink",
                                                                       "InfiniBand"))]
    assert len(lines) == 3
    x, y = lines[1].get_data()                               # NVLink: flat at the peak
    assert max(y) == pytest.approx(989.0)
    markers = [ln for ln in ax.get_lines() if ln.get_marker() == "v"]
    assert sorted(m.get_xdata()[0] for m in markers) == pytest.approx(
        sorted(c.intensity for c in cases[:2]))
