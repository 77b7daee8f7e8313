"""Lab 11's printed verdicts, computed from the numbers they print.

:func:`bubble_verdicts` reads a :class:`~mpu_lab.perf.pipeline_bubble.BubbleMeasurement` and
says, per micro-batch count, whether the measured idle share agrees with the formula
``(p-1)/(m+p-1)`` (Narayanan et al. 2021, §2.2.1) within a stated *relative* tolerance, and
when it does not, by how much and why: an absolute tolerance of 0.1 would call 0.19 against
0.11 agreement, though the measurement is 70 % above the formula.
"""
from __future__ import annotations

import textwrap

REL_TOL = 0.25      # relative: |measured - formula| <= 25 % of the formula


def agrees(measured: float, formula: float, rel_tol: float = REL_TOL) -> bool:
    """``|measured - formula| <= rel_tol * formula``."""
    return abs(measured - formula) <= rel_tol * formula


def bubble_verdicts(bubble, rel_tol: float = REL_TOL) -> str:
    """The measurement's head line, one row per micro-batch count (formula, measured share from
    the hooks, from CPU time, the relative difference and the verdict), then why they can
    differ, for each way they do."""
    head = bubble.summary().splitlines()[0]
    lines = [textwrap.fill(head, 100),
             f"{'m':>4}  {'(p-1)/(m+p-1)':>13}  {'measured idle':>13}  {'from CPU time':>13}  "
             f"{'difference':>10}  within {rel_tol:.0%} of the formula?"]
    for run in bubble.runs:
        cpu = f"{run.measured_cpu:.2f}" if run.measured_cpu is not None else "-"
        rel = (run.measured - run.formula) / run.formula
        ok = agrees(run.measured, run.formula, rel_tol)
        lines.append(f"{run.num_microbatches:>4}  {run.formula:>13.2f}  {run.measured:>13.2f}  "
                     f"{cpu:>13}  {rel:>+10.0%}  {'yes' if ok else 'no: they differ'}")
    if any(not agrees(r.measured, r.formula, rel_tol) and r.measured > r.formula
           for r in bubble.runs):
        lines.append("Above the formula: the messages and the barriers take time the formula "
                     "leaves out,\nand they weigh more where the bubble is small (many "
                     "micro-batches).")
    if any(not agrees(r.measured, r.formula, rel_tol) and r.measured < r.formula
           for r in bubble.runs):
        lines.append("Below the formula: a rank's busy time counted some waiting (one run of a "
                     "few iterations\nis noisy); run the cell again.")
    if any(r.measured_cpu is not None and r.measured_cpu > r.measured * (1 + rel_tol)
           for r in bubble.runs):
        lines.append("The CPU-time share is larger still: a rank was also off its core while it "
                     "had work\n(other processes on this machine), which its own wall clock "
                     "counts as idle.")
    return "\n".join(lines)
