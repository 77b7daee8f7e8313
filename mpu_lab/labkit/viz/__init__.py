"""Pictures and small views for the labs, and the figures in ``figures/``; one module per lab.

Every ``plot_*`` function builds and returns a :class:`matplotlib.figure.Figure` without touching
pyplot's global state: a notebook shows it by ending a cell with it, a script saves it
(:func:`save_figures`, run by ``python -m mpu_lab.labkit.notebooks figures``), a test inspects
it. The ``show_*`` / ``print_*`` functions print plain text in a fixed order (what nbval
compares). Every public name is importable from here (``viz.plot_rank_grid``).

* :mod:`~mpu_lab.labkit.viz.style` — the fixed style and colours every picture shares;
* lab 01, :mod:`~mpu_lab.labkit.viz.rank_groups` — the GPUs in their boxes, coloured by group,
  the walkthrough's tables, the interactive view;
* labs 04/05, :mod:`~mpu_lab.labkit.viz.splits` — column and row splits, ``f`` and ``g``;
* lab 06, :mod:`~mpu_lab.labkit.viz.collectives` — each rank's tensor before and after a
  collective, the collectives job's logs;
* lab 07, :mod:`~mpu_lab.labkit.viz.layer` — a transformer layer's collectives, its
  activation memory;
* lab 09, :mod:`~mpu_lab.labkit.viz.pipeline` — a pipeline's Gantt chart;
* lab 11, :mod:`~mpu_lab.labkit.viz.losses` — loss curves, a live loss plot;
* lab 12, :mod:`~mpu_lab.labkit.viz.performance` — utilisation, kernel timelines, step
  breakdowns, bandwidth, the cost model;
* :mod:`~mpu_lab.labkit.viz.figures` — the catalogue of ``figures/`` and byte-stable PNGs.
"""
from mpu_lab.labkit.collective_layouts import COLLECTIVE_LAYOUTS
from mpu_lab.labkit.viz.collectives import (
    collective_views,
    plot_collective,
    print_log_section,
    print_parallel_linear,
    print_test_log,
    show_collective,
)
from mpu_lab.labkit.viz.dp_overlap import plot_dp_timeline  # noqa: F401
from mpu_lab.labkit.viz.figures import figure_catalog, save_figure, save_figures
from mpu_lab.labkit.viz.layer import plot_activation_memory, plot_transformer_layer
from mpu_lab.labkit.viz.losses import LiveLossPlot, plot_loss_curves
from mpu_lab.labkit.viz.memory import plot_memory_breakdown, print_optimizer_saving  # noqa: F401
from mpu_lab.labkit.viz.overlap import plot_backward_timeline
from mpu_lab.labkit.viz.performance import (
    BREAKDOWN_COLORS,
    plot_bandwidth,
    plot_exploration,
    plot_kernel_timeline,
    plot_published_runs,
    plot_step_breakdown,
    plot_utilisation,
)
from mpu_lab.labkit.viz.pipeline import GANTT_COLORS, plot_gantt, plot_gantt_pair
from mpu_lab.labkit.viz.rank_groups import (
    FAMILY_NAMES,
    SHOWN_FAMILIES,
    describe_crossings,
    format_groups,
    groups_crossing_nodes,
    interactive_rank_groups,
    node_of,
    plot_group_families,
    plot_rank_grid,
    show_rank_groups,
)
from mpu_lab.labkit.viz.splits import (
    plot_column_split,
    plot_fg,
    plot_row_split,
    print_shard_shapes,
    shard_shapes,
    strided_owners,
)
from mpu_lab.labkit.viz.style import CROSSING, STYLE, group_colors, rank_colors

__all__ = [
    "plot_backward_timeline",
    "STYLE", "CROSSING", "group_colors", "rank_colors",
    "FAMILY_NAMES", "SHOWN_FAMILIES", "node_of", "groups_crossing_nodes", "format_groups",
    "plot_rank_grid", "describe_crossings", "plot_group_families", "show_rank_groups",
    "interactive_rank_groups",
    "shard_shapes", "print_shard_shapes", "strided_owners", "plot_column_split", "plot_row_split",
    "plot_fg",
    "COLLECTIVE_LAYOUTS", "plot_collective", "collective_views", "show_collective",
    "print_log_section", "print_test_log", "print_parallel_linear",
    "plot_transformer_layer", "plot_activation_memory",
    "GANTT_COLORS", "plot_gantt", "plot_gantt_pair",
    "plot_loss_curves", "LiveLossPlot",
    "BREAKDOWN_COLORS", "plot_utilisation", "plot_kernel_timeline", "plot_step_breakdown",
    "plot_bandwidth", "plot_published_runs", "plot_exploration",
    "figure_catalog", "save_figure", "save_figures",
]
