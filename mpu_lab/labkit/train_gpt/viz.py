"""Lab 14: loss curves that should coincide, and a loss curve redrawn while a job runs.

:func:`plot_loss_curves` (curves drawn so that ones lying on top of each other stay visible;
their relative differences on a log axis where fp32 rounding is a shaded band and exact zeros
are marked, so "equal within rounding" reads as such; a checkpoint line) and
:class:`LiveLossPlot` (its first frame already has its axes, the y-range from 0 to ln V, and
a note that it waits for the first step).
"""
from __future__ import annotations

import math
import time
from typing import Dict, Optional, Sequence

import matplotlib
from matplotlib.figure import Figure

from mpu_lab.labkit.style import STYLE, group_colors, new_figure, styled


_CURVE_STYLES = ({"linewidth": 4.0, "alpha": 0.45}, {"linewidth": 1.8, "linestyle": "--"},
                 {"linewidth": 1.4, "linestyle": ":"}, {"linewidth": 1.2, "linestyle": "-."})
# Relative differences up to this are fp32 rounding: 8 units in the last place of a float32
# (machine epsilon 2^-23), what sums taken in another order leave behind.
FP32_ROUNDING = 8 * 2.0 ** -23
_ZERO_AT = 1e-9           # where an exact 0 is drawn on the log axis (its tick reads "0"); a
                          # float32 loss near 1 differs from another by at least ~6e-8 relative


def _difference_panel(diff, curves: Dict[str, tuple], reference: str, colors, rtol: float):
    """Each curve's relative difference from ``reference``, as points: a shaded fp32-rounding
    band, exact zeros as open circles on the floor (whose tick reads 0), the check's tolerance
    as a line, and a y-range from the floor to just above the larger of the tolerance and the
    largest difference."""
    ref_at = dict(zip(*curves[reference]))
    top = 10 * rtol
    for k, (label, (its, losses)) in enumerate(curves.items()):
        if label == reference:
            continue
        pairs = [(i, abs(v - ref_at[i]) / abs(ref_at[i])) for i, v in zip(its, losses) if i in ref_at]
        if not pairs:
            continue
        top = max(top, 3 * max(r for _, r in pairs))
        nonzero = [(i, r) for i, r in pairs if r > 0]
        zeros = [i for i, r in pairs if r == 0]
        diff.plot([i for i, _ in nonzero], [r for _, r in nonzero], linestyle="none", marker=".",
                  markersize=5, color=colors[k], label=f"|{label} - {reference}| / {reference}")
        if zeros:
            diff.plot(zeros, [_ZERO_AT] * len(zeros), linestyle="none", marker="o", markersize=4,
                      markerfacecolor="white", color=colors[k],
                      label=f"{label}: exactly 0 at {len(zeros)} of {len(pairs)} iterations")
    diff.axhspan(_ZERO_AT / 3, FP32_ROUNDING, color="#4c72b0", alpha=0.12, linewidth=0,
                 label=f"fp32 rounding (up to 8 ulp, {FP32_ROUNDING:.0e})")
    diff.axhline(rtol, color="#c44e52", linewidth=1, linestyle="--",
                 label=f"the check's tolerance ({rtol:g})")
    diff.set_yscale("log")
    diff.set_ylim(_ZERO_AT / 3, top)
    ticks = [10.0 ** e for e in range(-8, int(math.floor(math.log10(top))) + 1, 2)]
    diff.set_yticks([_ZERO_AT] + ticks, ["0"] + [f"$10^{{{round(math.log10(t))}}}$" for t in ticks])
    diff.minorticks_off()
    diff.set_ylabel("relative difference")
    diff.legend(frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


@styled
def plot_loss_curves(curves: Dict[str, tuple], title: str = "", reference: Optional[str] = None,
                     checkpoint_at: Optional[int] = None, rtol: float = 1e-5) -> Figure:
    """Loss against iteration for each ``label: (iterations, losses)``, drawn so that curves
    lying on top of each other stay visible (wide pale line first, then dashed and dotted).
    ``reference``: add a lower panel with each other curve's relative difference from it, on
    a log axis where fp32 rounding is a shaded band, exact zeros are marked and ``rtol`` (the
    tolerance of the agreement check) is a line. ``checkpoint_at``: a vertical line at the
    iteration a checkpoint was saved and resumed."""
    fig = new_figure(10.5, 5.4 if reference else 3.6)
    if reference:
        ax, diff = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2.0, 1.2]})
    else:
        ax, diff = fig.add_subplot(), None
    colors = group_colors(len(curves))
    for k, (label, (its, losses)) in enumerate(curves.items()):
        ax.plot(its, losses, color=colors[k], label=label, **_CURVE_STYLES[k % len(_CURVE_STYLES)])
    if checkpoint_at is not None:
        for a in (ax, diff) if diff is not None else (ax,):
            a.axvline(checkpoint_at, color="#555555", linewidth=1, linestyle="--")
        ax.text(checkpoint_at, ax.get_ylim()[1], f" checkpoint (iteration {checkpoint_at})",
                va="top", fontsize=8, color="#555555")
    ax.set_ylabel("lm loss")
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(title, loc="left")
    if diff is not None:
        _difference_panel(diff, curves, reference, colors, rtol)
    (diff if diff is not None else ax).set_xlabel("iteration")
    for a in (ax, diff) if diff is not None else (ax,):
        for side in ("top", "right"):
            a.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


class LiveLossPlot:
    """A loss curve redrawn in place while a job runs (in a notebook: one output that is
    updated through an IPython display handle; elsewhere nothing is shown).

    ``vocab_size`` (the padded vocabulary the model's softmax runs over) fixes the y-range from
    0 to just above ``ln V``, the loss of a uniform guess, drawn as a dashed line, before the
    first step arrives (a note says it is waiting for it) and after. ``update(iterations,
    losses)`` redraws at most every ``every_s`` seconds (``force=True``: now)."""

    def __init__(self, title: str, total_iterations: int, every_s: float = 0.5,
                 vocab_size: Optional[int] = None):
        self._time = time.monotonic
        self.every_s, self._last = every_s, -1e9
        self.uniform = math.log(vocab_size) if vocab_size else None
        with matplotlib.rc_context(STYLE):
            self.fig = new_figure(8.0, 3.2)
            self.ax = self.fig.add_subplot()
            (self.line,) = self.ax.plot([], [], color=group_colors(1)[0], linewidth=1.6)
            self.ax.set_xlim(0, total_iterations)
            self.ax.set_xlabel("iteration")
            self.ax.set_ylabel("lm loss")
            self.ax.set_title(title, loc="left")
            if self.uniform is not None:
                self.ax.set_ylim(0, 1.1 * self.uniform)
                self.ax.axhline(self.uniform, color="#777777", linewidth=1, linestyle="--")
                self.ax.text(total_iterations, self.uniform, f"ln {vocab_size} = "
                             f"{self.uniform:.2f}: a uniform guess ", ha="right", va="bottom",
                             fontsize=8, color="#555555")
            self.waiting = self.ax.text(0.5, 0.5, "waiting for the first step ...",
                                        transform=self.ax.transAxes, ha="center", va="center",
                                        fontsize=10, color="#777777")
            for side in ("top", "right"):
                self.ax.spines[side].set_visible(False)
            self.fig.tight_layout()
        self.handle = None
        try:
            from IPython import get_ipython
            from IPython.display import display
            if get_ipython() is not None:
                self.handle = display(self.fig, display_id=True)
        except ImportError:
            pass

    def update(self, iterations: Sequence[int], losses: Sequence[float], force: bool = False):
        if not force and self._time() - self._last < self.every_s:
            return
        self._last = self._time()
        self.line.set_data(list(iterations), list(losses))
        if len(losses):
            self.waiting.set_visible(False)
            if self.uniform is not None:
                self.ax.set_ylim(0, 1.1 * max(self.uniform, max(losses)))
            else:
                low, high = min(losses), max(losses)
                pad = 0.05 * (high - low or 1.0)
                self.ax.set_ylim(low - pad, high + pad)
        if self.handle is not None:
            with matplotlib.rc_context(STYLE):
                self.handle.update(self.fig)
