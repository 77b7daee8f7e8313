"""Lab 07: loss curves that should coincide, and a loss curve redrawn while a job runs.

:func:`plot_loss_curves` (curves drawn so that ones lying on top of each other stay visible,
their relative differences, a checkpoint line) and :class:`LiveLossPlot`.
"""
from __future__ import annotations

import time
from typing import Dict, Optional, Sequence

import matplotlib
from matplotlib.figure import Figure

from mpu_lab.labkit.viz.style import STYLE, _figure, _styled, group_colors


_CURVE_STYLES = ({"linewidth": 4.0, "alpha": 0.45}, {"linewidth": 1.8, "linestyle": "--"},
                 {"linewidth": 1.4, "linestyle": ":"}, {"linewidth": 1.2, "linestyle": "-."})


@_styled
def plot_loss_curves(curves: Dict[str, tuple], title: str = "", reference: Optional[str] = None,
                     checkpoint_at: Optional[int] = None) -> Figure:
    """Loss against iteration for each ``label: (iterations, losses)``, drawn so that curves
    lying on top of each other stay visible (wide pale line first, then dashed and dotted).
    ``reference``: add a lower panel with each other curve's relative difference from it.
    ``checkpoint_at``: a vertical line at the iteration a checkpoint was saved and resumed."""
    fig = _figure(10.5, 5.2 if reference else 3.6)
    if reference:
        ax, diff = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2.2, 1]})
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
        ref_its, ref = curves[reference]
        ref_at = dict(zip(ref_its, ref))
        for k, (label, (its, losses)) in enumerate(curves.items()):
            if label == reference:
                continue
            rel = [max(abs(v - ref_at[i]) / abs(ref_at[i]), 1e-12) for i, v in zip(its, losses)
                   if i in ref_at]
            diff.plot([i for i in its if i in ref_at], rel, color=colors[k], marker=".",
                      linewidth=0.8, label=f"|{label} - {reference}| / {reference}")
        diff.axhline(1e-5, color="#c44e52", linewidth=1, linestyle="--", label="1e-5")
        diff.set_yscale("log")
        diff.set_ylim(1e-12, 1e-3)
        diff.set_ylabel("relative difference\n(0 drawn at 1e-12)")
        diff.legend(frameon=False, fontsize=7, ncol=3, loc="upper right")
    (diff if diff is not None else ax).set_xlabel("iteration")
    for a in (ax, diff) if diff is not None else (ax,):
        for side in ("top", "right"):
            a.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


class LiveLossPlot:
    """A loss curve redrawn in place while a job runs (in a notebook: one output that is
    updated through an IPython display handle; elsewhere nothing is shown).

    ``update(iterations, losses)`` redraws at most every ``every_s`` seconds (``force=True``:
    now); ``close()`` draws the final state."""

    def __init__(self, title: str, total_iterations: int, every_s: float = 0.5):
        self._time = time.monotonic
        self.every_s, self._last = every_s, -1e9
        with matplotlib.rc_context(STYLE):
            self.fig = _figure(8.0, 3.2)
            self.ax = self.fig.add_subplot()
            (self.line,) = self.ax.plot([], [], color=group_colors(1)[0], linewidth=1.6)
            self.ax.set_xlim(0, total_iterations)
            self.ax.set_xlabel("iteration")
            self.ax.set_ylabel("lm loss")
            self.ax.set_title(title, loc="left")
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
            low, high = min(losses), max(losses)
            pad = 0.05 * (high - low or 1.0)
            self.ax.set_ylim(low - pad, high + pad)
        if self.handle is not None:
            with matplotlib.rc_context(STYLE):
                self.handle.update(self.fig)
