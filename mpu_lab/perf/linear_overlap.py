"""What Megatron's linear does in backward, timed (``launch/linear_overlap.py`` runs it): a
sequence-parallel MLP, column- then row-parallel (Korthikanti et al. 2022 §4.2.2), with its
collectives overlapped by the gradient GEMMs, against the same layers with
``async_comm=False`` (Megatron's linear waiting for every collective at once, so each is
finished before the next GEMM starts: :mod:`mpu_lab.core.tensor_parallel.linear_autograd`).

:func:`parser` and :func:`check_args` (the script's ``PRECHECK``: sizes refused before any
process starts), :func:`measure` (runs inside a rank: median step time, and one backward pass
recorded step by step by :func:`record_backward`, from outside the layers: the GEMMs through a
``TorchDispatchMode`` that sees every ``aten.mm``, the collectives through
:class:`~mpu_lab.perf.comm_timing.CommTimer`), and :func:`predicted_backward`: the same backward
of the column-parallel layer on a GPU cluster, from the cost model's peak FLOP/s and link
bandwidth (labelled predicted: where the CPU cannot show the overlap, the lab shows this).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mpu_lab.training import initialize
from mpu_lab.perf.comm_timing import CommTimer
from mpu_lab.perf.cost_model import DGX_H100, Cluster


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


class GemmRecorder(TorchDispatchMode):
    """Records ``(start, end)`` (``time.perf_counter``) of every matrix product (``aten.mm``)
    that runs while it is active, in order."""

    def __init__(self):
        super().__init__()
        self.gemms: List[Tuple[float, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not torch.ops.aten.mm.default:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.gemms.append((start, time.perf_counter()))
        return out


# What linear_autograd's backward calls each of its collectives, by kind.
COLLECTIVE_NAMES = {"all_gather": "all-gather X", "reduce_scatter": "reduce-scatter dX",
                    "all_reduce": "all-reduce dX"}


@contextlib.contextmanager
def record_backward():
    """``with record_backward() as events:`` collects ``(what, start, end)`` (``time.perf_counter``
    seconds) of each step of the linear layers' backward: the GEMMs (each layer's backward runs
    two, ``dX = dY W`` first, then ``dW = dY^T X``: the order of
    ``linear_autograd``'s steps 2 and 5), and each asynchronous collective from the moment it
    was issued to the moment its ``wait()`` returned (it was in flight meanwhile). Filled in
    when the block ends, in order of start."""
    events: List[Tuple[str, float, float]] = []
    with GemmRecorder():            # the first op under a dispatch mode pays its set-up (seconds)
        torch.mm(torch.ones(1, 1), torch.ones(1, 1))   # cpu: a 1x1 warm-up of the mode, not rank data
    with CommTimer() as timer, GemmRecorder() as gemms:
        yield events
    events += [("dX = dY W" if k % 2 == 0 else "dW = dY^T X", start, end)
               for k, (start, end) in enumerate(gemms.gemms)]
    events += [(COLLECTIVE_NAMES[c.kind], c.issued_s, c.done_s) for c in timer.calls
               if c.is_async and c.done_s is not None]
    events.sort(key=lambda e: e[1])


def _step(col, row, x, dy) -> None:
    y, _ = row(F.gelu(col(x)[0]))
    y.backward(dy)


def measure(col, row, x, dy, steps: int) -> dict:
    """Median forward + backward step (ms) over ``steps`` after two warm-up steps, and one
    backward pass recorded: ``events`` = ``(what, start_ms, end_ms)`` from its start."""
    for _ in range(2):
        _step(col, row, x, dy)
    times = []
    for _ in range(steps):
        initialize.synchronize(x.device)
        start = time.perf_counter()
        _step(col, row, x, dy)
        initialize.synchronize(x.device)
        times.append(time.perf_counter() - start)
    y, _ = row(F.gelu(col(x)[0]))
    with record_backward() as events:
        initialize.synchronize(x.device)
        start = time.perf_counter()
        y.backward(dy)
        initialize.synchronize(x.device)
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


def predicted_backward(seq: int, batch: int, hidden: int, t: int, cluster: Cluster = DGX_H100,
                       bytes_per_value: int = 2, ffn_hidden: int = 0) -> dict:
    """The column-parallel fc1's backward under sequence parallelism, predicted for ``cluster``
    in the report format :func:`measure` gives (so the same picture draws it).

    fc1 is ``[s b, h] x [h, f/t]`` (``f = ffn_hidden`` or ``4 h``). Backward re-gathers its
    input (all-gather of ``s b h`` values), computes ``dX = dY W`` and ``dW = dY^T X``
    (``2 s b h f / t`` FLOPs each, at ``peak x matmul_efficiency``) and reduce-scatters ``dX``.
    A ring all-gather or reduce-scatter moves ``(t - 1)/t`` of the ``s b h`` values through each
    GPU's link (``intra_node_bandwidth x bandwidth_efficiency``, NVLink inside a node, plus the
    latency). Megatron overlaps the all-gather with ``dX`` and the reduce-scatter with ``dW``;
    serial runs the four one after another."""
    for name, value in (("seq", seq), ("batch", batch), ("hidden", hidden), ("t", t)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"predicted_backward needs a positive whole {name}, got {value!r}")
    if t > cluster.gpus_per_node:
        raise ValueError(f"t = {t} spans more than one node of {cluster.name} "
                         f"({cluster.gpus_per_node} GPUs): the prediction assumes NVLink")
    ffn = ffn_hidden or 4 * hidden
    gemm_s = 2 * seq * batch * hidden * ffn / t / (cluster.peak_flops * cluster.matmul_efficiency)
    wire = (t - 1) / t * seq * batch * hidden * bytes_per_value
    comm_s = cluster.latency_s * (t - 1) + wire / (cluster.intra_node_bandwidth
                                                   * cluster.bandwidth_efficiency)
    ms = lambda s: round(1e3 * s, 4)   # noqa: E731 (a local unit conversion)
    gemm, comm = ms(gemm_s), ms(comm_s)
    overlap = [("all-gather X", 0.0, comm), ("dX = dY W", 0.0, gemm)]
    second = max(comm, gemm)
    overlap += [("reduce-scatter dX", second, second + comm), ("dW = dY^T X", second, second + gemm)]
    serial, clock = [], 0.0
    for what, dur in (("all-gather X", comm), ("dX = dY W", gemm), ("reduce-scatter dX", comm),
                      ("dW = dY^T X", gemm)):
        serial.append((what, clock, round(clock + dur, 4)))
        clock = round(clock + dur, 4)
    modes = {"overlap": {"backward_ms": round(second + max(comm, gemm), 4), "events": overlap},
             "serial": {"backward_ms": clock, "events": serial}}
    return {"rank": 0, "t": t, "device": f"{cluster.name} (predicted)", "modes": modes,
            "gemm_ms": gemm, "collective_ms": comm}


def format_predicted(report: dict) -> str:
    """Two lines: the predicted GEMM and collective, then the backward of both modes and the
    share overlap saves."""
    over = report["modes"]["overlap"]["backward_ms"]
    serial = report["modes"]["serial"]["backward_ms"]
    return (f"{report['device']}, t = {report['t']}: each GEMM {report['gemm_ms']:.3f} ms, each "
            f"collective {report['collective_ms']:.3f} ms;\nbackward overlapped {over:.3f} ms, "
            f"serial {serial:.3f} ms ({100 * (serial - over) / serial:.0f} % saved)")
