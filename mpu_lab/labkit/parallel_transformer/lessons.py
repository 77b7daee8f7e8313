"""Lab 09's reading of the sequence-parallel layer's collectives (printed once the learner has
committed to a count), and its overlap verdict, computed from the step times it prints.

``launch/linear_overlap.py`` times the sequence-parallel MLP overlapped and serial on each rank
(:func:`mpu_lab.perf.linear_overlap.format_saving` prints them). What those numbers show is
decided here, per rank, with a stated relative tolerance, and said together with what the
machine can show: on a CPU whose ranks fill every core, gloo's thread has no idle unit to
run on, so a measured difference there is not the GPU's mechanism (a collective on the copy
engines and NVLink beside the GEMM on the compute units, Megatron-core's
``LinearWithGradAccumulationAndAsyncCommunication`` in ``tensor_parallel/layers.py``).
"""
from __future__ import annotations

import textwrap
from typing import Sequence

from mpu_lab.perf.comm_counts import expected_layer_counts

#: the relative difference of two step times below which they count as the same
TOLERANCE = 0.05


def explain_sp_layer_collectives(tp: int, width: int = 96) -> str:
    """Where the collectives of one sequence-parallel layer sit, per direction, with the counts
    of :func:`mpu_lab.perf.comm_counts.expected_layer_counts` (the answer to lab 09's
    prediction: printed by a cell stored without its output)."""
    counts = expected_layer_counts(True, tp)
    fwd, bwd = counts["forward"], counts["backward"]
    extra = bwd["all_gather"] - fwd["reduce_scatter"]
    paragraphs = [
        f"Forward, the f's and g's of the two blocks: {fwd['all_gather']} all-gathers + "
        f"{fwd['reduce_scatter']} reduce-scatters, and backward the other way round, "
        f"{fwd['reduce_scatter']} all-gathers + {fwd['all_gather']} reduce-scatters.",
        "One more all-gather hides in backward. A column-parallel layer needs its whole input X, "
        "[s,b,h], again for its weight gradient (dL/dW = dL/dY^T X). Keeping the gathered X "
        "would keep t times the activation that sequence parallelism has just split, so "
        "Megatron's linear (LinearWithGradAccumulationAndAsyncCommunication in "
        "tensor_parallel/layers.py) keeps only the rank's [s/t,b,h] block and all-gathers it "
        "again in backward, overlapped with the input-gradient GEMM (Korthikanti et al. 2022, "
        f"§4.2.2): {extra} more all-gathers, one per column-parallel layer, so "
        f"{bwd['all_gather']} all-gathers + {bwd['reduce_scatter']} reduce-scatters backward. "
        "mpu_lab's layers do the same (mpu_lab.core.tensor_parallel.linear_autograd mirrors "
        "that function), and the job below counts them.",
    ]
    return "\n\n".join(textwrap.fill(p, width, break_on_hyphens=False) for p in paragraphs)


def overlap_savings(reports: Sequence[dict]) -> list:
    """Per rank, the share of the serial step that overlap saved: 1 - overlapped / serial."""
    return [1 - r["modes"]["overlap"]["step_ms"] / r["modes"]["serial"]["step_ms"]
            for r in reports]


def overlap_verdict(reports: Sequence[dict], cores: int, tolerance: float = TOLERANCE) -> str:
    """What the printed step times show, from those numbers: a saving on every rank, a loss on
    every rank, or neither (beyond ``tolerance``, relative), and on a CPU whose ``cores`` the
    ranks fill, that the measurement cannot show the GPU's overlap either way."""
    saved = overlap_savings(reports)
    shares = ", ".join(f"{100 * s:+.0f} %" for s in saved)
    if min(saved) >= tolerance:
        seen = f"every rank saved at least {100 * min(saved):.0f} % ({shares})"
    elif max(saved) <= -tolerance:
        seen = f"every rank was slower overlapped ({shares})"
    else:
        beyond = sum(s >= tolerance for s in saved)
        seen = (f"a saving beyond {100 * tolerance:.0f} % on {beyond} of {len(saved)} ranks "
                f"only ({shares}): no clear saving")
    line = f"Measured with {len(reports)} ranks on {cores} cores:\n{seen}."
    if reports[0]["device"] == "cpu" and len(reports) >= cores:
        line += ("\nWith every core busy with a rank, gloo's thread has no idle unit to run on:"
                 "\nthis is not the GPU's overlap (see the prediction below), whatever its sign.")
    return line


# --------------------------------------------------------------------------- tables
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def format_split_shapes(dense_rows: Sequence[dict], split_rows: Sequence[dict], tp: int) -> str:
    """The lecture's two tables side by side, from :func:`mpu_lab.perf.layer_shapes.shape_table`
    rows measured at d_tp = 1 and at d_tp = ``tp``: each tensor's lecture shape, the two
    measured shapes and how many of it a rank holds at ``tp``; ``*`` marks the rows ``tp``
    changed."""
    if [r["name"] for r in dense_rows] != [r["name"] for r in split_rows]:
        raise ValueError(f"the tables list different tensors: {[r['name'] for r in dense_rows]} "
                         f"and {[r['name'] for r in split_rows]}")
    header = ("tensor", "lecture", "d_tp = 1", f"d_tp = {tp}", "per rank", "")
    body = []
    for one, split in zip(dense_rows, split_rows):
        # a report read back from JSON holds lists where the process's own rows hold tuples
        changed = (list(one["shape"]) != list(split["shape"])
                   or int(one["per_rank"]) != int(split["per_rank"]))
        body.append((one["name"], one["lecture"], " x ".join(map(str, one["shape"])),
                     " x ".join(map(str, split["shape"])), str(split["per_rank"]),
                     "*" if changed else ""))
    widths = [max(len(x[i]) for x in [header] + body) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
                     for line in [header] + body)


def format_layer_counts(per_layer: dict, expected: dict) -> str:
    """One row per layer and direction: the collectives counted on the ranks
    (``per_layer["layer0.forward"] = {"all_reduce": 2}``), then whether every layer issued the
    analysis's counts (``expected = {"forward": {...}, "backward": {...}}``)."""
    layers = sorted({tag.split(".")[0] for tag in per_layer if tag.startswith("layer")},
                    key=lambda name: int(name[len("layer"):]))
    lines = [f"{'layer':<8}{'direction':<11}" + "".join(f"{k:>16}" for k in KINDS)]
    same = bool(layers)
    for name in layers:
        for direction in ("forward", "backward"):
            got = per_layer.get(f"{name}.{direction}", {})
            same = same and got == expected[direction]
            lines.append(f"{name:<8}{direction:<11}" + "".join(f"{got.get(k, 0):>16}" for k in KINDS))
    lines.append(f"every layer issued the analysis's counts: {same}")
    return "\n".join(lines)
