"""The figures committed under figures/ (mpu_lab.labkit.figures): byte-stable, matching the code."""
import pathlib

import numpy as np
import pytest

from mpu_lab.labkit import figures as labkit_figures

REPO = pathlib.Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- figures/
def test_saved_pngs_are_byte_stable_and_carry_no_software_stamp(tmp_path):
    first = labkit_figures.save_figures(tmp_path / "a", ["fg_mlp_tp2.png"])[0].read_bytes()
    second = labkit_figures.save_figures(tmp_path / "b", ["fg_mlp_tp2.png"])[0].read_bytes()
    assert first == second
    assert b"Software" not in first and b"matplotlib" not in first.lower()


def test_committed_figures_match_the_figure_code(tmp_path):
    """figures/ is generated: `python -m mpu_lab.labkit.notebooks figures` after changing viz."""
    import matplotlib.image as mpimg
    names = sorted(labkit_figures.figure_catalog())
    assert sorted(p.name for p in (REPO / "figures").glob("*.png")) == names
    for path in labkit_figures.save_figures(tmp_path, names):
        fresh, committed = mpimg.imread(path), mpimg.imread(REPO / "figures" / path.name)
        assert fresh.shape == committed.shape and np.abs(fresh - committed).max() < 0.02, path.name


def test_unknown_figure_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown figure"):
        labkit_figures.save_figures(tmp_path, ["nope.png"])
