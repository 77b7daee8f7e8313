"""What Megatron's linear does in backward, timed (``launch/linear_overlap.py`` runs it): a
sequence-parallel MLP, column- then row-parallel (Korthikanti et al. 2022 §4.2.2), with its
collectives overlapped by the gradient GEMMs, against the same layers inside
``comm.no_overlap()`` (every collective finished before the next GEMM starts).

:func:`parser` and :func:`check_args` (the script's ``PRECHECK``: sizes refused before any
process starts), :func:`measure` (runs inside a rank: median step time, and one backward pass
recorded step by step by ``linear_autograd.record_backward``).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Sequence

import torch
import torch.nn.functional as F

from mpu_lab.tensor_parallel.linear_autograd import record_backward


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Megatron's linear in backward: overlapped vs serial")
    p.add_argument("--seq", type=int, default=512, help="sequence length s (divisible by t)")
    p.add_argument("--batch", type=int, default=4, help="micro-batch size b")
    p.add_argument("--hidden", type=int, default=256, help="hidden size h (MLP: h -> 4h -> h)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    p.add_argument("--quiet", action="store_true", help="report only, print nothing")
    return p


def check_args(argv: Sequence[str], world_size: int, cwd=None) -> argparse.Namespace:
    """Parse ``argv`` and refuse sizes that cannot be split over ``world_size`` = t ranks
    (``ValueError`` naming the numbers; pure, no process started). ``cwd`` is unused."""
    a = parser().parse_args([str(v) for v in argv])
    t = world_size
    bad = [f"--{name} {value} must be >= 1" for name, value in
           (("seq", a.seq), ("batch", a.batch), ("hidden", a.hidden), ("steps", a.steps))
           if value < 1]
    if a.seq >= 1 and a.seq % t:
        bad.append(f"--seq {a.seq} is not divisible by t = {t} ranks (sequence parallelism "
                   f"splits the sequence): use a multiple of {t}")
    if a.hidden >= 1 and (4 * a.hidden) % t:
        bad.append(f"4 x --hidden = {4 * a.hidden} is not divisible by t = {t} ranks")
    if bad:
        raise ValueError("linear_overlap.py: " + "; ".join(bad))
    return a


def _step(col, row, x, dy) -> None:
    y, _ = row(F.gelu(col(x)[0]))
    y.backward(dy)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(col, row, x, dy, steps: int) -> dict:
    """Median forward + backward step (ms) over ``steps`` after two warm-up steps, and one
    backward pass recorded: ``events`` = ``(what, start_ms, end_ms)`` from its start."""
    for _ in range(2):
        _step(col, row, x, dy)
    times = []
    for _ in range(steps):
        _sync(x.device)
        start = time.perf_counter()
        _step(col, row, x, dy)
        _sync(x.device)
        times.append(time.perf_counter() - start)
    y, _ = row(F.gelu(col(x)[0]))
    with record_backward() as events:
        _sync(x.device)
        start = time.perf_counter()
        y.backward(dy)
        _sync(x.device)
        backward_s = time.perf_counter() - start
    return {"step_ms": round(1e3 * statistics.median(times), 3),
            "backward_ms": round(1e3 * backward_s, 3),
            "events": [(what, round(1e3 * (t0 - start), 3), round(1e3 * (t1 - start), 3))
                       for what, t0, t1 in events]}


def in_flight(events) -> list:
    """``[(collective, [GEMMs that ran while it was in flight])]`` from one recorded backward:
    a GEMM counts when it started after the collective was issued and ended before it was
    known to be done. Serial mode gives empty lists."""
    gemms = [e for e in events if e[0].startswith(("dX", "dW"))]
    return [(what, [g[0] for g in gemms if start <= g[1] and g[2] <= end])
            for what, start, end in events if not what.startswith(("dX", "dW"))]


def format_in_flight(report: dict) -> str:
    """One line per mode and collective: what computed while it was in flight."""
    lines = []
    for mode, v in report["modes"].items():
        for what, during in in_flight(v["events"]):
            lines.append(f"{mode:<8} {what:<18} in flight during: {', '.join(during) or 'nothing'}")
    return "\n".join(lines)


def format_saving(reports) -> str:
    """Per rank: the median step overlapped and serial, and the share saved."""
    lines = []
    for r in reports:
        over, serial = r["modes"]["overlap"]["step_ms"], r["modes"]["serial"]["step_ms"]
        lines.append(f"rank {r['rank']}: overlapped {over:.1f} ms, serial {serial:.1f} ms "
                     f"({100 * (serial - over) / serial:+.0f} % saved) on {r['device']}")
    return "\n".join(lines)
