"""Lab 03's picture: where one device's bytes go for the small GPT, per recompute mode: the
parameters, gradients and optimizer states (counted from the tensors, the same in every mode)
under the activations autograd kept (counted with ``saved_tensors_hooks``)."""
from __future__ import annotations

from typing import Dict

from matplotlib.figure import Figure

from mpu_lab.labkit.style import group_colors, new_figure, styled

_KINDS = ("params", "grads", "optimizer", "activations")


@styled
def plot_memory_by_mode(state: Dict[str, int], activations: Dict[str, int],
                        title: str = "") -> Figure:
    """One stacked bar per recompute mode, in KiB: ``state`` (``params``, ``grads``,
    ``optimizer`` bytes) and ``activations[mode]`` (bytes kept for backward)."""
    missing = [k for k in _KINDS[:3] if k not in state]
    if missing or not activations:
        raise ValueError(f"state needs {list(_KINDS[:3])} (missing {missing}) and activations "
                         f"one mode at least, got {sorted(activations)}")
    fig = new_figure(6.0, 3.6)
    fig.set_layout_engine("constrained")
    ax = fig.add_subplot()
    colors = dict(zip(_KINDS, group_colors(len(_KINDS))))
    for i, (mode, act) in enumerate(activations.items()):
        bottom = 0.0
        for kind in _KINDS:
            value = (act if kind == "activations" else state[kind]) / 1024
            ax.bar(i, value, bottom=bottom, color=colors[kind], width=0.6,
                   label=kind if i == 0 else None)
            bottom += value
    ax.set_xticks(range(len(activations)), [f"recompute: {m}" for m in activations])
    ax.set_ylabel("KiB on the device")
    ax.set_title(title or "what one device keeps for a training step")
    ax.legend(loc="upper right", fontsize=8)
    return fig
