"""Lab 16's checks: predictions made with the back-of-envelope formulas
(:mod:`mpu_lab.perf.back_of_envelope`) before the explorer (:mod:`mpu_lab.perf.explorer`) is run.

Each ``check_*`` prints one verdict; a wrong answer gets a hint that points to the idea, never
the value. :func:`reveal` prints the answer and where it comes from, once the learner has
committed to one (the lab calls it in a cell stored without its output). The expected values
are computed from :mod:`mpu_lab.perf`, so they follow any parameters an instructor picks.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Sequence, Tuple

from mpu_lab.labkit.verdict import Verdict, as_int, as_floats, unanswered, verdict
from mpu_lab import perf
from mpu_lab.labkit.notebooks import leaks
from mpu_lab.labkit.performance.exercises import expected_dominant_communication
from mpu_lab.perf import back_of_envelope as be, explorer
from mpu_lab.perf.back_of_envelope import Traffic, links_of, ridge
from mpu_lab.perf.cost_model import Cluster

__all__ = ["check_bounds", "check_critical", "check_tp_share", "check_smallest_cp",
           "check_best_ep", "reveal"]

_BOUND_WORDS = {"compute": "compute-bound", "compute-bound": "compute-bound",
                "communication": "communication-bound", "comm": "communication-bound",
                "communication-bound": "communication-bound", "comm-bound": "communication-bound"}


def _bound_word(answer: Any):
    return _BOUND_WORDS.get(str(answer).strip().lower()) if isinstance(answer, str) else None


# Each expected_* returns (the answer, one line saying where it comes from).
def expected_bounds(traffic: Traffic, cluster: Cluster) -> Tuple[Tuple[str, ...], str]:
    """The verdict on each link of ``cluster`` (NVLink, then InfiniBand) at the datasheet's peak
    and bandwidths."""
    links = links_of(cluster)
    got = tuple(traffic.bound(cluster.peak_flops, bw) for bw in links.values())
    why = "; ".join(f"{name}: intensity {traffic.intensity:,.0f} FLOPs per byte against the "
                    f"ridge {ridge(cluster.peak_flops, bw):,.0f}"
                    for name, bw in links.items())
    return got, why


def expected_critical(traffic: Traffic, peak_flops: float, bandwidth: float
                      ) -> Tuple[float, str]:
    value = traffic.critical(peak_flops, bandwidth)
    return value, (f"{traffic.knob} = {value:,.0f}: where {traffic.intensity_formula} equals the "
                   f"ridge {ridge(peak_flops, bandwidth):,.0f} FLOPs per byte")


def expected_tp_share(result, t: int, p: int, b: int) -> Tuple[float, str]:
    cand = result.find(t, p, b=b)
    pred = cand.prediction
    share = pred.shares()["tp_comm"]
    return share, (f"t={t} p={p} b={b}: the explorer puts {share:.0%} of "
                   f"{pred.total_s:.1f} s on tensor-parallel communication "
                   f"(flags: {cand.short_flags() or 'none'})")


def expected_smallest_cp(example: Dict[str, Any]) -> Tuple[int, str]:
    fits = sorted(cp for cp, said in example["verdict"].items() if said == "fits")
    if not fits:
        return 0, "no cp of the example fits"
    said = ", ".join(f"cp={cp}: {v}" for cp, v in example["verdict"].items())
    return fits[0], f"cp = {fits[0]} ({said})"


def expected_best_ep(example: Dict[str, Any]) -> Tuple[int, str]:
    best = example["ranking"][0]
    c = best.config
    return best.ep, (f"ep = {best.ep}: the fastest configuration that fits is t={c.tp} "
                     f"p={c.pp} d={c.dp} ep={best.ep}, {best.total_s:.2f} s per iteration")


def check_bounds(answer: Any, traffic: Traffic, cluster: Cluster) -> Verdict:
    """A pair of verdicts, ``("compute", "communication")`` say: is ``traffic`` compute-bound
    or communication-bound on the cluster's NVLink, and on its InfiniBand?"""
    if unanswered(answer, 'a pair of "compute" or "communication": (NVLink, InfiniBand)'):
        return Verdict(False)
    want, why = expected_bounds(traffic, cluster)
    given = tuple(_bound_word(a) for a in answer) if isinstance(answer, (tuple, list)) else ()
    right = f"{want[0]} on NVLink, {want[1]} on InfiniBand ({why})."
    if len(given) != len(want) or None in given:
        return verdict(False, right, f"{answer!r} is not a pair of \"compute\" or "
                                     f"\"communication\" (NVLink first, then InfiniBand).")
    return verdict(given == want, right,
                   f"{answer!r} is not it. Hint: compare FLOPs per byte sent with the peak "
                   f"FLOP/s over each link's bytes per second; which side of the ridge is it?")


def check_critical(answer: Any, traffic: Traffic, peak_flops: float, bandwidth: float,
                   rel_tol: float = 0.05) -> Verdict:
    """The value of ``traffic.knob`` below which it is communication-bound on a link of
    ``bandwidth`` next to ``peak_flops``, within ``rel_tol``."""
    if unanswered(answer, f"a number: the {traffic.knob} where it turns communication-bound"):
        return Verdict(False)
    want, why = expected_critical(traffic, peak_flops, bandwidth)
    got = as_floats(answer)
    ok = got is not None and len(got) == 1 and abs(got[0] - want) <= rel_tol * want
    return verdict(ok, f"{why}.",
                   f"{answer!r} is not within {rel_tol:.0%}. Hint: the intensity grows in "
                   f"proportion to {traffic.knob}; set it equal to the ridge and solve.")


def check_tp_share(answer: Any, result, t: int, p: int, b: int, tol: float = 0.1) -> Verdict:
    """The share of the iteration the explorer's ``result`` puts on tensor-parallel
    communication for (t, p, b), within ``tol`` (an absolute share)."""
    if unanswered(answer, "a share between 0 and 1"):
        return Verdict(False)
    want, why = expected_tp_share(result, t, p, b)
    got = as_floats(answer)
    ok = got is not None and len(got) == 1 and abs(got[0] - want) <= tol
    return verdict(ok, f"{why}.",
                   f"{answer!r} is not within {tol:.2f}. Hint: with r = communication time over "
                   f"compute time, a share of r / (1 + r) goes to communication; r is the "
                   f"ridge of the link the group crosses over the intensity.")


def check_smallest_cp(answer: Any, example: Dict[str, Any]) -> Verdict:
    """The smallest context-parallel size with which some (t, p, d) fits in
    :func:`mpu_lab.perf.explorer.long_sequence_example`."""
    if unanswered(answer, "a context-parallel size cp"):
        return Verdict(False)
    want, why = expected_smallest_cp(example)
    return verdict(as_int(answer) == want, f"{why}.",
                   f"{answer!r} is not it. Hint: activations grow with s and cp divides them; "
                   f"how many GB does one stage hold at t = 8, and how many does a GPU have "
                   f"left after the weights and the optimizer?")


def check_best_ep(answer: Any, example: Dict[str, Any]) -> Verdict:
    """The expert-parallel size of the fastest fitting configuration of
    :func:`mpu_lab.perf.explorer.moe_example`."""
    if unanswered(answer, "an expert-parallel size ep"):
        return Verdict(False)
    want, why = expected_best_ep(example)
    return verdict(as_int(answer) == want, f"{why}.",
                   f"{answer!r} is not it. Hint: is the all-to-all inside a node "
                   f"communication-bound for this expert width? If not, what does a larger ep "
                   f"buy in memory, and what does it cost?")


_ANSWERS: Dict[Callable, Callable] = {
    check_bounds: expected_bounds, check_critical: expected_critical,
    check_tp_share: expected_tp_share, check_smallest_cp: expected_smallest_cp,
    check_best_ep: expected_best_ep}


def reveal(check: Callable, *args, **kwargs) -> None:
    """Print the answer to ``check`` (one of this module's ``check_*``) for the same inputs,
    with where it comes from: for after the learner has committed to an answer."""
    if check not in _ANSWERS:
        names: Sequence[str] = sorted(c.__name__ for c in _ANSWERS)
        raise ValueError(f"reveal knows {', '.join(names)}; got {check!r}")
    kwargs.pop("rel_tol", None)
    kwargs.pop("tol", None)
    _, why = _ANSWERS[check](*args, **kwargs)
    print(f"Answer: {why}")


# --------------------------------------------------------------------------- answers
# What lab 16's graded questions answer, for the leak check (mpu_lab.labkit.notebooks.leaks):
# the same expected_* the checks and reveal() use, at the arguments the lab passes (its models
# and clusters rebuilt here; the explorer's calls take milliseconds).
def _lab_answers():
    h100 = perf.DGX_H100
    gpt3 = perf.ModelShape(num_layers=96, hidden_size=12288, num_attention_heads=96,
                           seq_length=2048, vocab_size=51200, name="GPT-3 175B")
    share, _ = expected_tp_share(perf.explore(gpt3, perf.DGX_A100_80GB.replace(num_nodes=16),
                                              num_gpus=128, global_batch_size=1536), 32, 4, 8)
    critical, _ = expected_critical(be.tensor_parallel(4096, 4096, t=4), h100.peak_flops,
                                    h100.intra_node_bandwidth)
    cp, _ = expected_smallest_cp(explorer.long_sequence_example(seq_length=65536))
    ep, _ = expected_best_ep(explorer.moe_example())
    gpt39 = perf.ModelShape(num_layers=48, hidden_size=8192, num_attention_heads=64,
                            seq_length=2048, vocab_size=51200)
    best = perf.explore(gpt39, perf.DGX_A100_80GB.replace(num_nodes=8), 64, 512).best.config
    gpt13 = perf.ModelShape(num_layers=24, hidden_size=2048, num_attention_heads=16,
                            seq_length=2048, vocab_size=51200)
    split = perf.ParallelConfig(tp=2, pp=2, dp=8, micro_batch_size=1, global_batch_size=512,
                                sequence_parallel=True, recompute="selective")
    dominant = expected_dominant_communication(gpt13, split,
                                               perf.DGX_A100_80GB.replace(num_nodes=4))
    return [
        ("16", "critical width", [round(critical)], "check_critical("),
        ("16", "tp share t=32", [share, f"{share:.0%} of"], "check_tp_share("),
        ("16", "smallest cp", [cp, f"cp={cp}: fits", f"cp = {cp}"], "check_smallest_cp("),
        ("16", "best ep", [ep, f"ep = {ep}", f"ep={ep}"], "check_best_ep("),
        ("16", "best (t, p)", [(best.tp, best.pp), f"t={best.tp} p={best.pp}"],
         "check_best_config("),
        ("16", "dominant communication", [dominant], "check_dominant_communication("),
    ]


leaks.declare_answers(_lab_answers())
