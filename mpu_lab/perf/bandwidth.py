"""Collective bandwidth as nccl-tests reports it: algorithm and bus bandwidth, message sizes, fits.

NVIDIA nccl-tests, doc/PERFORMANCE.md ("Performance reported by NCCL tests"): the algorithm
bandwidth is ``algbw = S / t`` (:func:`algbw`), the bus bandwidth multiplies it by a factor
that makes it comparable with the hardware's link bandwidth whatever the number of ranks
(:func:`bus_factor`, :func:`busbw`; the ring all-reduce's 2(n-1)/n of Patarasuk & Yuan 2009).
``launch/bench_bandwidth.py`` runs the collectives over :func:`message_sizes`
(:func:`collective_numel`) and prints :func:`format_bandwidth`; :func:`allreduce_fit` turns
its all-reduce rows into the latency and bus bandwidth the cost model's ``Cluster`` takes.

The alpha-beta model of a ring collective (Thakur et al. 2005, §4; Patarasuk & Yuan 2009):
each of its :func:`ring_steps` costs a latency alpha, and every rank sends
:func:`bus_factor` x S bytes over its link at the bus bandwidth, so
``t = steps x alpha + bus_factor x S / busbw`` (:func:`alpha_beta_seconds`);
:func:`fit_alpha_beta` fits that line to measured rows (least squares on log time).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np

__all__ = ["COLLECTIVES", "bus_factor", "algbw", "busbw",
           "parse_size", "message_sizes", "collective_numel", "format_bandwidth", "best_busbw",
           "allreduce_fit", "ring_steps", "alpha_beta_seconds", "fit_alpha_beta"]

# NVIDIA nccl-tests, doc/PERFORMANCE.md ("Performance reported by NCCL tests"): the bus
# bandwidth is the algorithm bandwidth S/t times a factor that makes it comparable with the
# hardware's link bandwidth whatever the number of ranks n. A ring all-reduce moves every
# byte 2(n-1)/n times over each rank's link, all-gather and reduce-scatter (n-1)/n times
# (S being the *whole* gathered / scattered array), broadcast once (all data leave the root).
_BUS_FACTORS: Dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
COLLECTIVES: Tuple[str, ...] = tuple(_BUS_FACTORS)


def _check_op(op: str) -> None:
    if op not in _BUS_FACTORS:
        raise ValueError(f"unknown collective {op!r}; valid: {', '.join(COLLECTIVES)}")


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for collective ``op`` over ``n`` ranks (nccl-tests, doc/PERFORMANCE.md)."""
    _check_op(op)
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise ValueError(f"the number of ranks must be an integer >= 1, got {n!r}")
    return _BUS_FACTORS[op](int(n))


def algbw(size_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth ``S / t`` in bytes per second (``S``: the whole array)."""
    if size_bytes < 0:
        raise ValueError(f"size must be >= 0 bytes, got {size_bytes}")
    if not seconds > 0:
        raise ValueError(f"time must be > 0 seconds, got {seconds}")
    return size_bytes / seconds


def busbw(op: str, size_bytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in bytes per second: ``algbw x`` :func:`bus_factor`."""
    return algbw(size_bytes, seconds) * bus_factor(op, n)


_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024 ** 2, "MB": 1024 ** 2,
          "MIB": 1024 ** 2, "G": 1024 ** 3, "GB": 1024 ** 3, "GIB": 1024 ** 3}


def parse_size(text) -> int:
    """``"64K"`` -> 65536 (binary units, as nccl-tests' ``-b``/``-e``); ints pass through."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip().upper()
        digits = s.rstrip("KMGIB")
        unit = s[len(digits):]
        if not digits.isdigit() or unit not in _UNITS:
            raise ValueError(f"size {text!r} is not a byte count such as 1024, 64K, 16M or 1G")
        value = int(digits) * _UNITS[unit]
    if value < 1:
        raise ValueError(f"size must be >= 1 byte, got {text!r}")
    return value


def message_sizes(min_bytes, max_bytes, factor: int = 2) -> List[int]:
    """``min, min*factor, ...`` up to ``max`` (both in bytes or as ``"64K"``-style strings)."""
    lo, hi = parse_size(min_bytes), parse_size(max_bytes)
    if lo > hi:
        raise ValueError(f"minimum size {lo} bytes is larger than the maximum {hi} bytes")
    if factor < 2:
        raise ValueError(f"the size factor must be >= 2, got {factor}")
    sizes = [lo]
    while sizes[-1] * factor <= hi:
        sizes.append(sizes[-1] * factor)
    return sizes


def collective_numel(op: str, size_bytes: int, n: int, element_size: int) -> Tuple[int, int]:
    """``(numel of each rank's input tensor, whole-array bytes S actually moved)`` for a
    benchmark of ``op`` at nominal size ``size_bytes``: all-reduce and broadcast take the whole
    array, all-gather an ``S/n`` piece per rank, reduce-scatter the whole array (its output is
    ``S/n``). ``S`` is rounded down to a multiple of ``n`` elements (at least ``n``)."""
    _check_op(op)
    total = max(size_bytes // element_size, 1)
    if op in ("all_gather", "reduce_scatter"):
        total = max(total - total % n, n)
    per_rank = total // n if op == "all_gather" else total
    return per_rank, total * element_size


def _human_bytes(n: int) -> str:
    for unit, scale in (("G", 1024 ** 3), ("M", 1024 ** 2), ("K", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def format_bandwidth(rows: Sequence[Dict[str, Any]]) -> str:
    """The benchmark's rows as a table (time in microseconds, bandwidths in GB/s = 1e9 B/s)."""
    lines = [f"{'op':>15} {'size':>6} {'ranks':>5} {'time (us)':>11} {'algbw GB/s':>11} "
             f"{'busbw GB/s':>11}"]
    for r in rows:
        lines.append(f"{r['op']:>15} {_human_bytes(r['size_bytes']):>6} {r['ranks']:>5} "
                     f"{r['time_s'] * 1e6:11.1f} {r['algbw'] / 1e9:11.3f} {r['busbw'] / 1e9:11.3f}")
    return "\n".join(lines)


def best_busbw(rows: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """Per collective, the highest busbw over the message sizes (bytes/s)."""
    out: Dict[str, float] = {}
    for r in rows:
        out[r["op"]] = max(out.get(r["op"], 0.0), r["busbw"])
    return out



def allreduce_fit(rows: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """Latency and bus bandwidth of the all-reduce rows of ``launch/bench_bandwidth.py`` (the fit
    :func:`mpu_lab.perf.calibrate.calibrate_allreduce` uses; latency: the smaller of the two
    smallest messages' times; busbw: 2(n-1)/n · S / (t - latency) of the largest), so a
    benchmark already run can calibrate :func:`mpu_lab.perf.calibrate.cpu_cluster`."""
    mine = sorted((r for r in rows if r["op"] == "all_reduce"), key=lambda r: r["size_bytes"])
    if len(mine) < 2:
        raise ValueError("need all_reduce rows of at least two sizes (run bench_bandwidth.py "
                         "with --ops all_reduce and --max-bytes > --min-bytes)")
    latency = min(r["time_s"] for r in mine[:2])
    big, n = mine[-1], mine[-1]["ranks"]
    busbw_ = bus_factor("all_reduce", n) * big["size_bytes"] / max(big["time_s"] - latency, 1e-9)
    return dict(latency_s=latency, busbw=busbw_, nproc=n,
                rows=[(r["size_bytes"], r["time_s"]) for r in mine])


# Messages each rank sends one after another in the ring algorithm (Thakur et al. 2005, §4;
# Patarasuk & Yuan 2009): a reduce-scatter and an all-gather pass n-1 chunks each, an
# all-reduce is the two, a pipelined broadcast hands the array down a chain of n-1 links.
_RING_STEPS: Dict[str, Callable[[int], int]] = {
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "broadcast": lambda n: n - 1,
}


def ring_steps(op: str, n: int) -> int:
    """How many messages each rank sends one after another in a ring ``op`` over ``n`` ranks."""
    bus_factor(op, n)                                   # checks op and n
    return _RING_STEPS[op](int(n))


def alpha_beta_seconds(op: str, size_bytes: float, n: int, alpha_s: float,
                       busbw_: float) -> float:
    """The alpha-beta time of a ring ``op`` on ``n`` ranks for a whole array of ``size_bytes``:
    ``ring_steps x alpha_s + bus_factor x size_bytes / busbw_`` (``alpha_s``: seconds per
    message; ``busbw_``: bytes/s one rank's link carries)."""
    if alpha_s < 0:
        raise ValueError(f"alpha must be >= 0 seconds, got {alpha_s}")
    if not busbw_ > 0:
        raise ValueError(f"bus bandwidth must be > 0 bytes/s, got {busbw_}")
    if size_bytes < 0:
        raise ValueError(f"size must be >= 0 bytes, got {size_bytes}")
    return ring_steps(op, n) * alpha_s + bus_factor(op, n) * size_bytes / busbw_


def fit_alpha_beta(rows: Sequence[Dict[str, Any]], op: str = "all_reduce") -> Dict[str, Any]:
    """Fit ``t = latency + bus_factor x S / busbw`` to the ``op`` rows of
    ``launch/bench_bandwidth.py`` (one number of ranks) by least squares on ``log(fit / t)``:
    the small messages (where the latency shows) weigh as much as the large ones, and a row
    twice too slow counts as much as one twice too fast. Returns ``latency_s`` (the fitted
    constant), ``alpha_s`` (it per ring step, see :func:`ring_steps`), ``busbw`` (bytes/s),
    ``nproc``, ``max_rel_error`` (the worst row's ``|fit - t| / t``) and ``rows``
    (``(S, t, fitted t)``)."""
    mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["size_bytes"])
    ranks = {r["ranks"] for r in mine}
    if len(ranks) > 1:
        raise ValueError(f"{op} rows from several numbers of ranks {sorted(ranks)}: fit one")
    if len({r["size_bytes"] for r in mine}) < 2:
        raise ValueError(f"need {op} rows of at least two sizes to fit a line, got {len(mine)}")
    n = mine[0]["ranks"]
    sizes = np.array([float(r["size_bytes"]) for r in mine])
    times = np.array([float(r["time_s"]) for r in mine])
    # least squares on log(fit / t): a row twice too slow and a row twice too fast count
    # the same, small arrays as much as large ones. Gauss-Newton from the fit of relative
    # errors (a straight least-squares problem), kept to latency >= 0 and slope > 0.
    design = np.stack([np.ones_like(sizes), sizes], axis=1) / times[:, None]   # row: (1, S) / t
    params, *_ = np.linalg.lstsq(design, np.ones_like(times), rcond=None)
    params = np.maximum(params, [0.0, 1e-30])
    for _ in range(100):
        fit = params[0] + params[1] * sizes
        jacobian = np.stack([np.ones_like(sizes), sizes], axis=1) / fit[:, None]
        step, *_ = np.linalg.lstsq(jacobian, np.log(times) - np.log(fit), rcond=None)
        scale = 1.0
        while np.any(params + scale * step <= [-1e-30, 0.0]) and scale > 1e-6:
            scale /= 2                    # stay where the model is defined
        params = np.maximum(params + scale * step, [0.0, 1e-30])
        if np.all(np.abs(scale * step) <= 1e-12 * np.maximum(np.abs(params), 1e-30)):
            break
    latency, slope = float(params[0]), float(params[1])
    fitted = latency + slope * sizes
    steps = ring_steps(op, n)
    return dict(op=op, nproc=n, latency_s=latency, alpha_s=latency / steps if steps else 0.0,
                busbw=bus_factor(op, n) / slope,
                max_rel_error=float(np.max(np.abs(fitted - times) / times)),
                rows=[(int(s), float(t), float(f)) for s, t, f in zip(sizes, times, fitted)])

