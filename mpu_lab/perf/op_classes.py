"""Where a rank's step went, op class by op class, from its ``torch.profiler`` trace.

``train_gpt.py --breakdown-profile DIR`` writes each rank's Chrome trace of the timed steps
(:class:`mpu_lab.perf.breakdown.StepTimer`). :func:`op_class_profile` books every instant of
one rank's main thread under one of the classes the cost model (:mod:`mpu_lab.perf.cost_model`) has a term
for, plus the one it had none for, so a prediction can be set against a run term by term
(:func:`compare_terms`):

* **matmul** — the GEMMs: ``aten::mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` and the fused
  attention kernels of SDPA (``aten::_scaled_dot_product_…``) (its QKᵀ and weighted sum are matmul FLOPs in the model). The model's
  ``matmul_s``.
* **non-matmul** — every other ``aten::`` op outside the optimizer: layer norms, GeLU, adds,
  copies, the loss. The model's memory-bound ``elementwise_s``.
* **communication** — c10d / gloo ops, and the wait of a synchronous collective. A blocking
  ``dist.all_reduce`` on gloo waits for its work in C++ without a profiler span of its own, so
  the wait shows as the *self time* of the span that called it (``_ReduceFromModelParallelRegion``,
  ``_VocabParallelCrossEntropy``, a linear layer's backward waiting for its input-gradient
  all-reduce): the self time of any span with a communication op among its children is booked
  here. It also holds some Python of those spans, and on a busy machine the wait for a peer that
  was descheduled. The model's ``tp_comm_s + pp_p2p_s + bubble_s + dp_comm_s``.
* **optimizer** — everything inside ``Optimizer.step`` / ``Optimizer.zero_grad`` (torch's own
  annotations). The model's ``optimizer_s``.
* **framework** — the rest of the step: the autograd engine's and custom ``Function``\\ s' own
  time, dispatch above the kernels (a composite op's self time counts under non-matmul), and
  Python between ops (no op open). The model's ``framework_s``.

The profiler itself adds a few microseconds to every op it records, so a profiled step is longer
than an unprofiled one, most of the difference in **framework**; :func:`compare_terms` therefore
also reports each class's *share* of the profiled step. On a GPU trace the device's kernels are
classified instead (GEMM / attention kernels, NCCL kernels, the rest) and **framework** is the time
no kernel ran.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Dict, List, Optional, Sequence, Tuple

from mpu_lab.perf.kernel_timeline import (ENCLOSING_PREFIXES, GPU_CATEGORIES, is_communication,
                                          load_trace, trace_device)

__all__ = ["OP_CLASSES", "MATMUL_OPS", "OpClassProfile", "op_class", "op_class_profile",
           "op_class_profiles", "predicted_classes", "compare_terms", "format_terms"]

OP_CLASSES = ("matmul", "non-matmul", "communication", "optimizer", "framework")
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                        "aten::addbmm"})
# SDPA's fused CPU kernels (aten::_scaled_dot_product_flash_attention_for_cpu and its
# backward); the composite aten::scaled_dot_product_attention above them only dispatches.
_FUSED_ATTENTION_PREFIX = "aten::_scaled_dot_product"
_GPU_MATMUL_WORDS = ("gemm", "cutlass", "xmma", "flash", "attention", "sdpa", "cublas")
_OPTIMIZER_PREFIX = "Optimizer."


def op_class(name: str, has_comm_child: bool = False) -> str:
    """The class of a CPU trace span by its name (outside the optimizer): see the module
    docstring. ``has_comm_child``: the span called a communication op, so its own time is the
    collective's wait."""
    if name in MATMUL_OPS or name.startswith(_FUSED_ATTENTION_PREFIX):
        return "matmul"
    if is_communication(name):
        return "communication"
    if has_comm_child:
        return "communication"
    if name.startswith("aten::"):
        return "non-matmul"
    return "framework"


@dataclasses.dataclass
class OpClassProfile:
    """One rank's profiled steps by class: ``seconds[c]`` per step for each of
    :data:`OP_CLASSES`, ``step_s`` (the profiled window per step) and ``ops`` (spans recorded per
    step on the main thread; on a GPU, kernels)."""
    rank: int
    device: str
    steps: int
    step_s: float
    seconds: Dict[str, float]
    ops: float

    def shares(self) -> Dict[str, float]:
        return {c: s / self.step_s for c, s in self.seconds.items()}


def _main_thread(events: List[dict]) -> List[dict]:
    counts = collections.Counter(e.get("tid") for e in events if e.get("cat") == "cpu_op")
    if not counts:
        raise ValueError("the trace holds no CPU op")
    tid = counts.most_common(1)[0][0]
    return [e for e in events if e.get("tid") == tid]


def _cpu_classes(events: List[dict]) -> Tuple[Dict[str, float], Tuple[float, float], int]:
    events = _main_thread([e for e in events if e.get("cat") in ("cpu_op", "user_annotation")])
    optimizer = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
                       for e in events if str(e["name"]).startswith(_OPTIMIZER_PREFIX))
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), str(e["name"]))
                   for e in events if not str(e["name"]).startswith((_OPTIMIZER_PREFIX,)
                                                                    + ENCLOSING_PREFIXES))
    if not spans:
        raise ValueError("the trace holds no op on its main thread")
    # which spans directly enclose a communication op (their self time is its wait)
    parent_of_comm = set()
    stack: List[int] = []
    for i, (a, b, name) in enumerate(spans):
        while stack and spans[stack[-1]][1] <= a:
            stack.pop()
        if stack and is_communication(name):
            parent_of_comm.add(stack[-1])
        stack.append(i)
    points = sorted({p for s in spans for p in s[:2]} | {p for s in optimizer for p in s})
    lo, hi = points[0], points[-1]
    acc = dict.fromkeys(OP_CLASSES, 0.0)
    heap: List[Tuple[float, float, int]] = []
    i = j = 0
    for t, nxt in zip(points, points[1:]):
        while i < len(spans) and spans[i][0] <= t:
            heapq.heappush(heap, (-spans[i][0], spans[i][1], i))
            i += 1
        while heap and heap[0][1] <= t:
            heapq.heappop(heap)
        while j < len(optimizer) and optimizer[j][1] <= t:
            j += 1
        if j < len(optimizer) and optimizer[j][0] <= t:
            acc["optimizer"] += nxt - t
        elif heap:
            k = heap[0][2]
            acc[op_class(spans[k][2], k in parent_of_comm)] += nxt - t
        else:
            acc["framework"] += nxt - t
    return acc, (lo, hi), len(spans)


def _gpu_classes(events: List[dict]) -> Tuple[Dict[str, float], Tuple[float, float], int]:
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), str(e["name"]))
                     for e in events if str(e.get("cat", "")).lower() in GPU_CATEGORIES)
    if not kernels:
        raise ValueError("the trace holds no kernel")
    acc = dict.fromkeys(OP_CLASSES, 0.0)
    lo, hi = kernels[0][0], max(b for _, b, _ in kernels)
    covered = lo
    for a, b, name in kernels:             # overlapping kernels: the earlier one keeps the time
        a = max(a, covered)
        if b <= a:
            continue
        low = name.lower()
        cls = ("communication" if "nccl" in low else
               "matmul" if any(w in low for w in _GPU_MATMUL_WORDS) else "non-matmul")
        acc[cls] += b - a
        covered = b
    acc["framework"] = (hi - lo) - sum(acc.values())
    return acc, (lo, hi), len(kernels)


def op_class_profile(trace, steps: int, rank: Optional[int] = None) -> OpClassProfile:
    """Classify one rank's trace (a path or the loaded JSON) holding ``steps`` profiled steps
    (the report's ``steps``): seconds per step in each class. The window runs from the first
    recorded span to the last."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    trace = load_trace(trace) if isinstance(trace, str) else trace
    events = [e for e in trace.get("traceEvents", ()) if e.get("ph") == "X"]
    device = trace_device(trace)
    acc, (lo, hi), count = (_gpu_classes if device == "cuda" else _cpu_classes)(events)
    if rank is None:
        rank = int(trace.get("distributedInfo", {}).get("rank", 0))
    return OpClassProfile(rank=rank, device=device, steps=steps, step_s=(hi - lo) / 1e6 / steps,
                          seconds={c: v / 1e6 / steps for c, v in acc.items()},
                          ops=count / steps)


def op_class_profiles(reports: Sequence[dict]) -> List[OpClassProfile]:
    """Every rank's :class:`OpClassProfile` from its ``train_gpt.py --breakdown-profile``
    report (a job's ``results`` or their ``"breakdown"``), in rank order."""
    out = []
    for rank, item in enumerate(reports):
        b = item.get("breakdown", item) if item else None
        if not b or "profile" not in b:
            raise ValueError(f"rank {rank}: no trace in its report: run train_gpt.py with "
                             f"--breakdown-profile DIR")
        out.append(op_class_profile(b["profile"]["trace"], int(b["steps"]), rank=b.get("rank", rank)))
    return sorted(out, key=lambda p: p.rank)


def predicted_classes(prediction) -> Dict[str, float]:
    """A :class:`~mpu_lab.perf.cost_model.IterationPrediction`'s terms mapped onto
    :data:`OP_CLASSES` (seconds per iteration)."""
    return {"matmul": prediction.matmul_s, "non-matmul": prediction.elementwise_s,
            "communication": prediction.tp_comm_s + prediction.pp_p2p_s + prediction.bubble_s
            + prediction.dp_comm_s, "optimizer": prediction.optimizer_s,
            "framework": prediction.framework_s}


def compare_terms(profiles: Sequence[OpClassProfile], prediction,
                  measured_step_s: Optional[float] = None) -> List[dict]:
    """One row per class: ``predicted_s``, ``measured_s`` (the slowest rank's profiled seconds
    per step, as the slowest rank sets the pace) and ``measured_share`` of its profiled step.
    With ``measured_step_s`` (the same run's unprofiled step), ``scaled_s`` is that share of it:
    the profiler's own overhead taken out proportionally."""
    slowest = max(profiles, key=lambda p: p.step_s)
    predicted = predicted_classes(prediction)
    rows = []
    for c in OP_CLASSES:
        share = slowest.seconds[c] / slowest.step_s
        row = dict(term=c, predicted_s=predicted[c], measured_s=slowest.seconds[c],
                   measured_share=share)
        if measured_step_s is not None:
            row["scaled_s"] = share * measured_step_s
        rows.append(row)
    total = dict(term="total", predicted_s=prediction.total_s, measured_s=slowest.step_s,
                 measured_share=1.0)
    if measured_step_s is not None:
        total["scaled_s"] = measured_step_s
    return rows + [total]


def format_terms(rows: Sequence[dict]) -> str:
    """Fixed-width table of :func:`compare_terms` rows (milliseconds)."""
    scaled = "scaled_s" in rows[0]
    head = f"{'term':<15}{'predicted ms':>13}{'profiled ms':>13}{'share':>7}"
    head += f"{'unprofiled ms':>15}{'ratio':>7}" if scaled else ""
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (f"{r['term']:<15}{r['predicted_s'] * 1e3:>13.1f}{r['measured_s'] * 1e3:>13.1f}"
                f"{r['measured_share']:>7.0%}")
        if scaled:
            ratio = r["scaled_s"] / r["predicted_s"] if r["predicted_s"] > 0 else float("inf")
            line += f"{r['scaled_s'] * 1e3:>15.1f}{ratio:>7.2f}" if ratio != float("inf") \
                else f"{r['scaled_s'] * 1e3:>15.1f}{'-':>7}"
        lines.append(line)
    return "\n".join(lines)
