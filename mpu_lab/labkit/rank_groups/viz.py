"""Lab 01: Megatron's rank groups on a picture of the machine (and lab 13: the expert groups,
``ep`` / ``expert-dp`` / ``expert-tp``, on the same picture).

:func:`plot_rank_grid`, :func:`plot_group_families` (GPUs in boxes of ``gpus_per_node``,
coloured by group; groups that leave a box are hatched, thick outline), :func:`format_groups`
(the MPU walkthrough's tables), :func:`show_rank_groups` and its ipywidgets front end
:func:`interactive_rank_groups`; the box arithmetic behind them (:func:`node_of`,
:func:`groups_crossing_nodes`).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Rectangle

from mpu_lab.core import parallel_state
from mpu_lab.labkit.style import (
    CROSSING,
    LABEL_BOX,
    display_figure,
    group_colors,
    new_figure,
    styled,
)

FAMILY_NAMES = {
    "tp": "tensor model-parallel", "pp": "pipeline model-parallel", "dp": "data_parallel",
    "cp": "context-parallel", "tp-pp": "model-parallel", "dp-cp": "data+context-parallel",
    "tp-dp": "tensor+data-parallel", "tp-cp": "tensor+context-parallel",
    "tp-dp-cp": "tensor+data+context-parallel", "embedding": "embedding",
    "position-embedding": "position-embedding",
    "ep": "expert model-parallel", "expert-tp": "expert tensor-parallel",
    "expert-dp": "expert data-parallel", "expert-tp-ep": "expert tensor+model-parallel",
    "expert-tp-ep-pp": "expert model-parallel (with pp)",
}
# Order in which show_rank_groups lists families: the walkthrough's first (dp, tp, pp).
SHOWN_FAMILIES = ("dp", "tp", "pp", "cp", "tp-pp")
# ... and, with expert parallelism (ep > 1), the expert families after them.
EXPERT_FAMILIES = ("ep", "expert-dp")


def node_of(rank: int, gpus_per_node: int) -> int:
    """The box (node) that holds ``rank`` when ranks fill boxes in order, as torchrun does."""
    return rank // gpus_per_node


def groups_crossing_nodes(groups: Sequence[Sequence[int]], gpus_per_node: int) -> List[List[int]]:
    """The groups whose ranks do not all sit in one box of ``gpus_per_node`` GPUs."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    return [list(g) for g in groups if len({node_of(r, gpus_per_node) for r in g}) > 1]


def format_groups(groups: Dict[str, List[List[int]]], families: Iterable[str] = ("dp", "tp", "pp"),
                  limit: Optional[int] = None) -> str:
    """The MPU walkthrough's listing: ``8 data_parallel groups:`` then ``[g0, g2], [g1, g3], ...``;
    ``limit``: at most that many groups per family, then ``... (N more)``."""
    lines = []
    for fam in families:
        shown = groups[fam] if limit is None else groups[fam][:limit]
        listed = ", ".join("[" + ", ".join(f"g{r}" for r in g) + "]" for g in shown)
        if len(shown) < len(groups[fam]):
            listed += f", ... ({len(groups[fam]) - len(shown)} more)"
        lines.append(f" {len(groups[fam])} {FAMILY_NAMES.get(fam, fam)} groups:")
        lines.append(f" {listed}")
    return "\n".join(lines)


@styled
def plot_rank_grid(groups: Sequence[Sequence[int]], world_size: int, gpus_per_node: int = 8,
                   title: str = "", ax=None):
    """Draw ``world_size`` GPUs, ``gpus_per_node`` to a box, coloured by their group.

    Each square shows the rank (``g5``) and, below it, the index of its group. Groups whose
    members sit in more than one box are hatched and outlined in black. Returns the Axes.
    """
    if ax is None:
        height = 0.9 * _nodes(world_size, gpus_per_node) + 0.8
        ax = new_figure(max(4.0, 0.75 * gpus_per_node + 1), height).add_subplot()
    nodes = _nodes(world_size, gpus_per_node)
    index = {r: i for i, g in enumerate(groups) for r in g}
    colors = group_colors(len(groups))
    crossing = {r for g in groups_crossing_nodes(groups, gpus_per_node) for r in g}
    for node in range(nodes):
        y = nodes - 1 - node   # node 0 on top
        ax.add_patch(FancyBboxPatch((-0.12, y - 0.1), gpus_per_node + 0.24 - 0.0, 0.86,
                                    boxstyle="round,pad=0.02,rounding_size=0.08",
                                    facecolor="#f4f4f4", edgecolor="#555555", linewidth=1.2))
        first, last = node * gpus_per_node, min(world_size, (node + 1) * gpus_per_node) - 1
        ax.text(-0.3, y + 0.33, f"node {node}\nranks {first}-{last}", ha="right", va="center",
                fontsize=8, color="#333333")
        for slot in range(gpus_per_node):
            rank = node * gpus_per_node + slot
            if rank >= world_size:
                continue
            face = colors[index[rank]] if rank in index else "white"
            ax.add_patch(Rectangle((slot + 0.06, y), 0.88, 0.66, facecolor=face,
                                   edgecolor=CROSSING if rank in crossing else "#222222",
                                   linewidth=2.6 if rank in crossing else 0.8,
                                   hatch="///" if rank in crossing else None))
            ax.text(slot + 0.5, y + 0.43, f"g{rank}", ha="center", va="center", fontsize=9,
                    fontweight="bold", bbox=LABEL_BOX if rank in crossing else None)
            if rank in index:
                ax.text(slot + 0.5, y + 0.15, f"#{index[rank]}", ha="center", va="center",
                        fontsize=7)
    ax.set_xlim(-2.0, gpus_per_node + 0.3)
    ax.set_ylim(-0.25, nodes)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left")
    return ax


def _nodes(world_size: int, gpus_per_node: int) -> int:
    return -(-world_size // gpus_per_node)


def describe_crossings(groups: Dict[str, List[List[int]]], gpus_per_node: int,
                       families: Iterable[str] = ("tp", "dp", "pp")) -> str:
    """One line per family: how many of its groups leave their box, and which."""
    lines = []
    for fam in families:
        cross = groups_crossing_nodes(groups[fam], gpus_per_node)
        which = "" if not cross else ": " + ", ".join(str(g) for g in cross[:4]) + \
            (", ..." if len(cross) > 4 else "")
        lines.append(f"{fam:>3} groups crossing a node boundary: {len(cross)} of "
                     f"{len(groups[fam])}{which}")
    return "\n".join(lines)


@styled
def plot_group_families(world_size: int = 16, tp: int = 2, pp: int = 4, cp: int = 1,
                        order: str = parallel_state.DEFAULT_ORDER, gpus_per_node: int = 8,
                        families: Sequence[str] = ("tp", "dp", "pp"), ep: int = 1,
                        etp=None) -> Figure:
    """One panel per group family (tensor, data, pipeline by default) of the same world;
    ``ep`` / ``etp``: the expert layout, for the expert families (``"ep"``, ``"expert-dp"``,
    ``"expert-tp"``)."""
    groups = parallel_state.generate_rank_groups(world_size, tp, pp, cp, order, ep, etp)
    nodes = _nodes(world_size, gpus_per_node)
    width = max(5.5, 0.8 * gpus_per_node + 2.2)
    fig = new_figure(width, len(families) * (0.85 * nodes + 0.55) + 0.4)
    axes = fig.subplots(len(families), 1, squeeze=False)[:, 0]
    for ax, fam in zip(axes, families):
        cross = len(groups_crossing_nodes(groups[fam], gpus_per_node))
        title = (f"{FAMILY_NAMES.get(fam, fam)} groups ({fam}): {len(groups[fam])} groups of "
                 f"{len(groups[fam][0])}; {cross} cross a node boundary"
                 + (" (hatched)" if cross else ""))
        plot_rank_grid(groups[fam], world_size, gpus_per_node, title=title, ax=ax)
    dp = world_size // (tp * pp * cp)
    experts = f", ep={ep}" + (f", etp={etp}" if etp is not None else "") if ep > 1 else ""
    fig.suptitle(f"n={world_size} GPUs, {gpus_per_node} per node: t={tp}, p={pp}, c={cp}, "
                 f"d={dp}{experts}, order {order!r}", x=0.02, ha="left", fontsize=11)
    fig.tight_layout()
    return fig


def show_rank_groups(world_size: int = 16, tp: int = 2, pp: int = 4, cp: int = 1,
                     order: str = parallel_state.DEFAULT_ORDER, gpus_per_node: int = 8,
                     draw: bool = True, ep: int = 1) -> None:
    """Print the groups of one configuration and draw them — the body of lab 01's widget.

    A configuration that does not tile the world prints the reason instead of raising, so
    the interactive view keeps working while a learner moves the sliders. Returns None (so
    neither ``interact`` nor a notebook cell shows the figure a second time). ``ep`` > 1 adds
    the expert groups (expert-tensor-parallel size = t, Megatron's default).
    """
    try:
        groups = parallel_state.generate_rank_groups(world_size, tp, pp, cp, order, ep)
    except ValueError as exc:
        print(f"not a valid configuration: {exc}")
        return None
    dp = world_size // (tp * pp * cp)
    experts = f", ep = {ep}, expert dp = {world_size // (tp * ep * pp)}" if ep > 1 else ""
    print(f"n = {world_size} = t*p*c*d = {tp}*{pp}*{cp}*{dp}{experts}   (order {order!r}, "
          f"{gpus_per_node} GPUs per node)")
    families = [f for f in SHOWN_FAMILIES if f != "cp" or cp > 1]
    families += list(EXPERT_FAMILIES) if ep > 1 else []
    print(format_groups(groups, families, limit=8))
    basic = [f for f in ("tp", "cp", "dp", "pp", *EXPERT_FAMILIES) if f in families]
    print(describe_crossings(groups, gpus_per_node, basic))
    if not draw:
        return None
    fig = plot_group_families(world_size, tp, pp, cp, order, gpus_per_node,
                              families=basic, ep=ep)
    display_figure(fig)


# What a saved notebook shows in place of the sliders (they live only while a kernel runs).
WIDGET_HINT = "[sliders for world size, tp, pp, cp, ep, order and box size: run this cell in Jupyter]"


def format_job_ranks(results) -> str:
    """One row per rank of a ``launch/rank_groups.py`` job (``job.results``, rank order): its
    coordinates, its tensor, data and pipeline groups, and the all-reduce of the rank numbers
    over each group (``sums``)."""
    fams = ("tp", "dp", "pp")
    rows = [("rank", "tp_rank", "dp_rank", "pp_rank", "tp group", "dp group", "pp group",
             "sum tp", "sum dp", "sum pp")]
    for res in results:
        rows.append((str(res["rank"]), *(str(res[f"{f}_rank"]) for f in fams),
                     *(str(res["groups"][f]) for f in fams), *(str(res["sums"][f]) for f in fams)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i < 4 or i > 6 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows)


def interactive_rank_groups(world_size: int = 16, tp: int = 2, pp: int = 4, cp: int = 1,
                            order: str = parallel_state.DEFAULT_ORDER, gpus_per_node: int = 8,
                            ep: int = 1) -> None:
    """ipywidgets sliders for :func:`show_rank_groups` (world size, t, p, c, ep, order, box
    size).

    The view is displayed with :data:`WIDGET_HINT` as its plain-text form, so a notebook saved
    without a live kernel (or run by papermill, which keeps no widget) shows that line instead
    of the widget's ``interactive(children=(IntSlider(...`` repr. A figure is redrawn when a
    slider is released, not at every step of a drag. Returns None.
    """
    import ipywidgets as widgets    # optional (the labs extra): only when the widget is shown
    from IPython.display import display   # IPython comes with ipywidgets

    orders = ["tp-cp-ep-dp-pp", "tp-cp-dp-pp", "tp-cp-pp-dp", "tp-pp-dp", "dp-tp-pp", "pp-dp-tp"]
    if order not in orders:
        orders.insert(0, order)

    def slider(value, low, high, label):
        return widgets.IntSlider(value=value, min=low, max=high, description=label,
                                 continuous_update=False)

    view = widgets.interactive(
        show_rank_groups,
        world_size=slider(world_size, 1, 64, "world size"), tp=slider(tp, 1, 16, "tp"),
        pp=slider(pp, 1, 16, "pp"), cp=slider(cp, 1, 8, "cp"), ep=slider(ep, 1, 16, "ep"),
        order=widgets.Dropdown(options=orders, value=order, description="order"),
        gpus_per_node=slider(gpus_per_node, 1, 16, "GPUs/node"), draw=widgets.fixed(True))
    bundle = view._repr_mimebundle_()
    bundle["text/plain"] = WIDGET_HINT
    display(bundle, raw=True)
