"""Lab 07's readings, printed by reveal cells (stored empty) once the learner has committed to
the MLP's all-reduces, which they answer: the two operators around the MLP
(:func:`explain_mlp_operators`), and ``launch/linear_options.py``'s table line by line, what each
row-parallel option's input is and which of its collectives come from which operator."""
from __future__ import annotations

import textwrap
from typing import Sequence

from mpu_lab.labkit.column_parallel.viz import format_calls


_FULL_INPUT = ("the input is the full [b, in]; the layer keeps its block of columns (the "
               "scatter, no communication forward). Forward: g all-reduces the partial sums; "
               "backward: the scatter's gradient all-gathers the input gradient.")
_OWN_INPUT = ("the input is already this rank's [b, in/t] (a column-parallel layer with "
              "gather_output=False makes it): only g communicates.")
# the case names of launch/linear_options.py's row layer and MLP
_WHY = {
    "input_is_parallel=False": _FULL_INPUT,
    "input_is_parallel=True": _OWN_INPUT,
    "skip_bias_add=True": _OWN_INPUT + " The full bias [out] comes back to the caller, to be "
                                       "added later (Megatron fuses it with dropout and the "
                                       "residual).",
    "mlp": "GeLU(XA)B from a column layer (gather_output=False) and a row layer "
           "(input_is_parallel=True): only f (before A) and g (after B) communicate, each in "
           "one direction. The attention block adds its own f and g (lab 09 counts them).",
}


def explain_row_options(results: Sequence[dict]) -> str:
    """One line per row-layer option and MLP of the job's report (rank 0's cases; every rank
    agrees, as the table shows): its collectives per pass as counted, then why."""
    lines = ["Line by line:"]
    for case in results[0]["cases"]:
        key = "mlp" if case["layer"] == "mlp" else case["name"]
        if case["layer"] not in ("row", "mlp") or key not in _WHY:
            continue
        counted = (f"forward {format_calls(case['forward'])}; "
                   f"backward {format_calls(case['backward'])}")
        name = f"{case['layer']} {case['name'] if key != 'mlp' else ''}".rstrip()
        lines.append(textwrap.fill(f"- {name} ({counted}): {_WHY[key]}", 96,
                                   subsequent_indent="  "))
    return "\n".join(lines)


def explain_mlp_operators(width: int = 96) -> str:
    """f and g around GeLU(XA)B, what each does in each pass (Shoeybi et al. 2019, §3,
    Fig. 3a), and so the MLP's all-reduces per pass."""
    text = ("The partial sums of the row-parallel layer must be added: the operator g "
            "(reduce_from_tensor_model_parallel_region) all-reduces them forward and passes the "
            "gradient through unchanged backward (each X_i A_i term has the gradient dL/dY). The "
            "paper puts a second operator before A: f (copy_to_tensor_model_parallel_region), "
            "identity forward and all-reduce backward (lab 06, section 4), since every rank's "
            "block of columns contributes a part of the input's gradient. So the MLP all-reduces "
            "once forward (g) and once backward (f), and nothing happens between A and B: "
            "GeLU works on each rank's block of columns as it is.")
    return textwrap.fill(text, width, break_on_hyphens=False)
