"""The figures committed under ``figures/``: the catalogue and byte-stable PNGs.

``python -m mpu_lab.labkit.notebooks figures`` writes them (:func:`save_figures`).
"""
from __future__ import annotations

import pathlib
from typing import Callable, Dict, Iterable, List, Optional

import matplotlib
from matplotlib.figure import Figure

from mpu_lab.labkit.parallel_transformer.viz import plot_transformer_layer
from mpu_lab.labkit.performance.viz import plot_utilisation
from mpu_lab.labkit.rank_groups.viz import plot_group_families
from mpu_lab.labkit.column_parallel.viz import plot_column_split, plot_fg, plot_row_split
from mpu_lab.labkit.style import STYLE
from mpu_lab.perf.utilisation import schedule_utilisation


def figure_catalog() -> Dict[str, Callable[[], Figure]]:
    """The figures committed under ``figures/``, by file name (built on demand)."""
    return {
        "rank_groups_tp2_pp4_16gpu.png": lambda: plot_group_families(16, 2, 4),
        "rank_groups_tp4_pp2_16gpu.png": lambda: plot_group_families(16, 4, 2),
        "rank_groups_tp_slowest_16gpu.png": lambda: plot_group_families(16, 2, 4, order="pp-dp-tp"),
        "column_split_tp2.png": lambda: plot_column_split(1024, 512, 2),
        "column_split_stride3_tp2.png": lambda: plot_column_split(1024, 768, 2, stride=3),
        "row_split_tp2.png": lambda: plot_row_split(1024, 512, 2),
        "fg_mlp_tp2.png": lambda: plot_fg(2),
        "transformer_layer_tp2.png": lambda: plot_transformer_layer(2),
        "transformer_layer_tp2_sp.png": lambda: plot_transformer_layer(2, sequence_parallel=True),
        "utilisation_pipeline_m1_vs_m8.png": _schedule_utilisation_figure,
    }


def _schedule_utilisation_figure() -> Figure:
    """Lab 15: what a perfect machine would show for a 4-stage 1F1B pipeline fed 1 or 8
    micro-batches per iteration (three iterations)."""
    return plot_utilisation({f"p = 4, m = {m}": schedule_utilisation("1f1b", 4, m) for m in (1, 8)},
                            "Busy (100 %) or waiting, per pipeline stage: 1F1B, three iterations",
                            xlabel="time (one forward pass = 1)")


def save_figure(fig: Figure, path) -> pathlib.Path:
    """Save ``fig`` as a byte-stable PNG (no software/date metadata, fixed dpi)."""
    path = pathlib.Path(path)
    with matplotlib.rc_context(STYLE):
        fig.savefig(path, dpi=STYLE["savefig.dpi"], metadata={"Software": None},
                    facecolor="white")
    return path


def save_figures(directory, names: Optional[Iterable[str]] = None) -> List[pathlib.Path]:
    """Write the catalogue's figures (or only ``names``) into ``directory``; return the paths."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    catalog = figure_catalog()
    wanted = list(names) if names is not None else list(catalog)
    unknown = [n for n in wanted if n not in catalog]
    if unknown:
        raise ValueError(f"unknown figure(s) {unknown}; known: {sorted(catalog)}")
    return [save_figure(catalog[name](), directory / name) for name in wanted]

