"""Lab 09's overlap verdict, computed from the step times it prints.

``launch/linear_overlap.py`` times the sequence-parallel MLP overlapped and serial on each rank
(:func:`mpu_lab.perf.linear_overlap.format_saving` prints them). What those numbers show is
decided here, per rank, with a stated relative tolerance, and said together with what the
machine can show: on a CPU whose ranks fill every core, gloo's thread has no idle unit to
run on, so a measured difference there is not the GPU's mechanism (a collective on the copy
engines and NVLink beside the GEMM on the compute units, Megatron-core's
``LinearWithGradAccumulationAndAsyncCommunication`` in ``tensor_parallel/layers.py``).
"""
from __future__ import annotations

from typing import Sequence

#: the relative difference of two step times below which they count as the same
TOLERANCE = 0.05


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
        seen = f"no saving on every rank beyond {100 * tolerance:.0f} % ({shares})"
    line = f"Measured with {len(reports)} ranks on {cores} cores: {seen}."
    if reports[0]["device"] == "cpu" and len(reports) >= cores:
        line += ("\nWith every core busy with a rank, gloo's thread has no idle unit to run on:"
                 "\nthis is not the GPU's overlap (see the prediction below), whatever its sign.")
    return line
