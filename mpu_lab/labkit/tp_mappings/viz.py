"""Lab 08: each rank's tensor before and after a collective.

:func:`plot_collective` draws one column per rank; :func:`collective_views` and
:func:`show_collective` rebuild the pictures of one test of ``launch/collectives.py``
(Megatron's tensor-parallel unit tests, run on the layouts of
:data:`~mpu_lab.megatron_reference.collective_layouts.COLLECTIVE_LAYOUTS`) from the job's per-rank reports;
:func:`print_test_log`, :func:`print_log_section` and :func:`print_parallel_linear` print the
jobs' logs and reports as text.
"""
from __future__ import annotations

import textwrap
from typing import List, Optional, Sequence

import numpy as np
from matplotlib.figure import Figure

from mpu_lab.core import parallel_state
from mpu_lab.megatron_reference.collective_layouts import COLLECTIVE_LAYOUTS
from mpu_lab.labkit.style import display_figure, group_colors, new_figure, styled


def _as_2d(values) -> Optional[np.ndarray]:
    if values is None:          # this rank holds nothing (e.g. a broadcast receiver before)
        return None
    arr = np.asarray(values, dtype=float)
    if arr.ndim == 0:
        arr = arr.reshape(1, 1)
    elif arr.ndim == 1:
        arr = arr.reshape(1, -1)
    elif arr.ndim > 2:
        arr = arr.reshape(-1, arr.shape[-1])
    return arr


def _summary(arr: np.ndarray, max_chars: Optional[int] = None) -> str:
    """``2x4, all 3`` / ``1x16: 0 x8, 1 x8`` (runs, when few) / ``8x8``; only the shape when the
    runs would be longer than ``max_chars`` (the caption under a panel must not reach the next)."""
    shape = f"{arr.shape[0]}x{arr.shape[1]}"
    flat = arr.ravel()
    if not flat.size:
        return shape
    runs = []
    for v in flat:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    if len(runs) == 1:
        text = f"{shape}, all {runs[0][0]:g}"
    elif len(runs) <= 4:
        text = f"{shape}: " + ", ".join(f"{v:g} x{n}" for v, n in runs)
    else:
        text = shape
    return text if max_chars is None or len(text) <= max_chars else shape


# characters of a 7-point caption per inch of panel (about 0.55 em per character)
_CAPTION_CHARS_PER_INCH = 72 / (0.55 * 7)


@styled
def plot_collective(title: str, before: Sequence, after: Sequence,
                    groups: Optional[Sequence[Sequence[int]]] = None,
                    labels: Sequence[str] = ("before", "after")) -> Figure:
    """Each rank's tensor before and after a collective, one column per rank.

    ``before``/``after``: per rank (rank order), nested lists or arrays (0-, 1- or 2-D; more
    dimensions are flattened to 2-D). Small tensors get their values written in; all panels
    share one colour scale. ``groups`` (e.g. the tensor-parallel groups) are marked above the
    columns so one sees which ranks talked to each other.
    """
    before = [_as_2d(b) for b in before]
    after = [_as_2d(a) for a in after]
    if len(before) != len(after):
        raise ValueError(f"{len(before)} 'before' tensors but {len(after)} 'after' tensors")
    n = len(before)
    present = [a.ravel() for a in before + after if a is not None]
    values = np.concatenate(present) if present else np.zeros(1)
    vmin, vmax = float(values.min()), float(values.max())
    if vmin == vmax:
        vmin, vmax = vmin - 1, vmax + 1
    width = max(6.0, 1.25 * n + 1.0)
    fig = new_figure(width, 3.3)
    # a panel is about 0.8 of its column: its caption stays inside it
    max_chars = int(0.8 * (width - 0.6) / n * _CAPTION_CHARS_PER_INCH)
    axes = fig.subplots(2, n, squeeze=False)
    group_of = {}
    if groups:
        for i, g in enumerate(groups):
            for r in g:
                group_of[r] = i
    gcolors = group_colors(len(groups)) if groups else []
    for row, (name, tensors) in enumerate(zip(labels, (before, after))):
        for r, arr in enumerate(tensors):
            ax = axes[row, r]
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_ylabel(name, fontsize=9)
            if row == 0:
                ax.set_title(f"rank {r}", fontsize=9,
                             color=gcolors[group_of[r]] if r in group_of else "black",
                             fontweight="bold" if r in group_of else "normal")
            if arr is None:
                ax.text(0.5, 0.5, "nothing", ha="center", va="center", fontsize=8,
                        color="#777777", transform=ax.transAxes)
                ax.set_xlabel("-", fontsize=7)
                continue
            ax.imshow(arr, cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto",
                      interpolation="nearest")
            if arr.size <= 16 and arr.shape[1] <= 8:
                for (i, j), v in np.ndenumerate(arr):
                    shade = (v - vmin) / (vmax - vmin)
                    ax.text(j, i, f"{v:g}", ha="center", va="center", fontsize=7,
                            color="white" if shade < 0.6 else "black")
            ax.set_xlabel(_summary(arr, max_chars), fontsize=7)
    sub = ""
    if groups:
        sub = "  (groups: " + " ".join(str(list(g)) for g in groups) + ")"
    # a 10-point title: about 13 characters an inch, wrapped to the figure's width; the groups
    # go on a line of their own rather than be cut inside a group
    chars = int(13 * (width - 0.2))
    text = title + sub if len(title + sub) <= chars else (
        textwrap.fill(title, chars) + ("\n" + sub.strip() if sub else ""))
    fig.suptitle(text, x=0.01, ha="left", fontsize=10)
    fig.tight_layout()
    return fig


def _filled(values, n):
    return [float(v) for v in values for _ in range(n)]


def collective_views(name: str, results: Sequence[dict]) -> List[tuple]:
    """``(title, before, after, tp_groups)`` per picture of one test of ``launch/collectives.py``.

    ``results`` are the job's per-rank reports (``job.results``). The *after* side is what each
    rank reported; the *before* side is the input the test builds on each rank (a rank's own
    number, an ``arange``...), rebuilt here from the same rule.
    """
    tp, pp = COLLECTIVE_LAYOUTS[name]
    world = len(results)
    groups = parallel_state.generate_rank_groups(world, tp, pp)["tp"]
    group_of = {r: g for g in groups for r in g}
    got = [res["tests"][name] for res in results]
    ranks = range(world)
    if name == "broadcast":
        before = [[0.0, 1.0] if r == group_of[r][0] else None for r in ranks]
        after = [g["means"] for g in got]
        return [("broadcast_data([0, 1], ...): keys 0 and 1 (8x8 of 0s, of 1s; means shown) go "
                 "from each group's first rank to the others", before, after, groups)]
    if name in ("copy", "reduce"):
        what = ("copy_to_tensor_model_parallel_region, backward (f: all-reduce)" if name == "copy"
                else "reduce_from_tensor_model_parallel_region, forward (g: all-reduce)")
        return [(what, [[float(r)] for r in ranks], [[g["value"]] for g in got], groups)]
    if name == "scatter":
        full = np.arange(8 * tp, dtype=float).reshape(8, tp)
        before = [full for _ in ranks]
        after = [full[:, g["column"]:g["column"] + 1].T for g in got]
        return [("scatter_to_tensor_model_parallel_region: each rank keeps its column of the "
                 f"(8, {tp}) input (shown transposed)", before, after, groups)]
    if name == "gather":
        before = [[float(r)] * 8 for r in ranks]
        after = [_filled(g["blocks"], 8) for g in got]
        return [("gather_from_tensor_model_parallel_region: all-gather along the last dimension",
                 before, after, groups)]
    if name == "gather_split":
        before = [np.full((2, 4), float(r)) for r in ranks]
        after = [g["output"] for g in got]
        return [("gather_split_1d_tensor: the group's flattened (2, 4) tensors, concatenated",
                 before, after, groups)]
    if name == "sequence":
        seq = np.arange(2 * tp * 4, dtype=float).reshape(2 * tp, 4)
        scatter_after = [seq[g["rows"][0]:g["rows"][1]] for g in got]
        gather_after = [np.array(_filled(group_of[r], 4)).reshape(tp, 4) for r in ranks]
        rows = np.array([[float(i)] * 4 for i in range(tp)])
        rs_after = [[g["reduce_scatter"]] * 4 for g in got]
        return [
            (f"scatter_to_sequence_parallel_region: each rank keeps its block of the {2 * tp} "
             f"sequence rows (dim 0)", [seq for _ in ranks], scatter_after, groups),
            ("gather_from_sequence_parallel_region: all-gather along the sequence (dim 0)",
             [[float(r)] * 4 for r in ranks], gather_after, groups),
            (f"reduce_scatter_to_sequence_parallel_region: sum the ({tp}, 4) inputs, keep row "
             f"tp_rank", [rows for _ in ranks], rs_after, groups),
        ]
    raise ValueError(f"unknown test {name!r}; known: {sorted(COLLECTIVE_LAYOUTS)}")


def show_collective(name: str, results: Sequence[dict]) -> List[Figure]:
    """Display the before/after picture(s) of one collectives test; return the figures."""
    figs = [plot_collective(title, before, after, groups)
            for title, before, after, groups in collective_views(name, results)]
    for fig in figs:
        display_figure(fig)
    return figs


def print_log_section(lines: Sequence[str], start: str, end: str) -> None:
    """Print one section of a rank's log: from the first line starting with ``start`` through
    the next line starting with ``end`` (both included)."""
    inside, shown = False, 0
    for text in lines:
        inside = inside or text.startswith(start)
        if inside:
            print(text)
            shown += 1
            if shown > 1 and text.startswith(end):
                return
    if not shown:
        print(f"(no log section starting with {start!r})")


def print_test_log(lines: Sequence[str], name: str) -> None:
    """Print test ``name``'s part of a ``launch/collectives.py`` log (rank 0's lines, which
    hold every rank's line in rank order): from ``== name`` to ``name: passed ...``."""
    print_log_section(lines, f"== {name} ", f"{name}: ")


def _rank_list(ranks: Sequence[int]) -> str:
    """``0-3`` for consecutive ranks, ``0, 4`` otherwise."""
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(str(r) for r in ranks)


def _test_inputs(name: str, tp: int) -> str:
    return {
        "broadcast": "each group's first rank holds keys 0-7 (8x8 tensors of k), the others None",
        "copy": "rank r holds [r]; f's backward",
        "reduce": "rank r holds [r]; g's forward",
        "scatter": f"every rank holds arange({8 * tp}) as (8, {tp})",
        "gather": "rank r holds 8 copies of r",
        "gather_split": "rank r holds a (2, 4) tensor of r",
        "sequence": f"every rank holds arange({8 * tp}) as ({2 * tp}, 4); reduce-scatter: row i "
                    f"of ({tp}, 4) is i",
    }[name]


def _test_after(name: str, got: dict, tp: int) -> str:
    if name == "broadcast":
        return f"keys [0, 1] from rank {got['src']}, means {got['means'][0]:g}, {got['means'][1]:g}"
    if name in ("copy", "reduce"):
        return f"[{got['value']:g}], the sum over the group"
    if name == "scatter":
        c = got["column"]
        return f"column {c}: {[c + tp * i for i in range(8)]}"
    if name == "gather":
        return f"8 copies each of {got['blocks']}"
    if name == "gather_split":
        runs = _summary(np.asarray(got["output"], dtype=float).reshape(1, -1)).split(": ", 1)[-1]
        return f"{runs} ({len(got['output'])} values)"
    if name == "sequence":
        a, b = got["rows"]
        return f"scatter keeps rows [{a}, {b}); reduce-scatter keeps [{got['reduce_scatter']:g}]"
    raise ValueError(f"unknown test {name!r}; known: {sorted(COLLECTIVE_LAYOUTS)}")


def print_test_table(name: str, results: Sequence[dict], log: Sequence[str] = ()) -> None:
    """Test ``name`` of ``launch/collectives.py`` as one table: a row per set of ranks that end
    with the same tensor (they agree, so one row says it for all of them), from the job's
    per-rank reports; ``log`` (rank 0's lines) says whether every rank passed its asserts."""
    tp, pp = COLLECTIVE_LAYOUTS[name]
    rows: dict = {}
    for res in results:
        rows.setdefault(_test_after(name, res["tests"][name], tp), []).append(res["rank"])
    passed = next((line for line in log if line.startswith(f"{name}: passed")), None)
    print(f"{name} (tp={tp}, pp={pp}): {_test_inputs(name, tp)}")
    print(f"{'ranks':<12}after (the same on every rank of the row)")
    for after, ranks in rows.items():
        print(f"{_rank_list(ranks):<12}{after}")
    print(passed[len(name) + 2:] if passed else "the log holds no 'passed' line: see job.output(0)")


def print_parallel_linear(results: Sequence[dict], kind: str = "column") -> None:
    """One row per rank of a ``launch/parallel_linear.py`` job, floats reduced to verdicts."""
    print(f"{kind} parallel, tp={results[0]['tp']}")
    print("rank  tp_rank  A_i            weight         slice of master  "
          "output == dense  grads within 1e-6")
    for res in results:
        r = res[kind]
        grads = max(r["output_error"], r["input_grad_error"], r["weight_grad_error"]) <= 1e-6
        exact = ("bit-exact" if r["output_bit_exact"] else
                 "within 1e-6" if r["output_error"] <= 1e-6 else "NO")
        print(f"{res['rank']:>4}  {r['tp_rank']:>7}  {str(r['A_shape']):<13}  "
              f"{str(r['weight_shape']):<13}  {str(r['shard_is_master_slice']):<15}  "
              f"{exact:<15}  {grads}")

