"""Lab 02's checks: the bytes each rank sends in a ring all-reduce (:func:`check_ring_send_bytes`,
the lab's prediction), and the write-the-code exercise :data:`RING_ALL_REDUCE`: an all-reduce
built from point-to-point messages around a ring (a reduce-scatter of n - 1 steps, then an
all-gather of n - 1 steps; Patarasuk & Yuan 2009), run on a live world and held on every rank
to :func:`mpu_lab.core.comm.all_reduce`, to the collectives it called (none) and to the bytes it sent
(2 (n - 1) chunks of 1/n of the array, no more)."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from mpu_lab.core import comm, parallel_state
from mpu_lab.training import initialize
from mpu_lab.labkit.verdict import Verdict, unanswered, verdict
from mpu_lab.labkit.c10d_calls import C10dCalls
from mpu_lab.labkit.grader import Case, Exercise, Outcome, compare
from mpu_lab.labkit.notebooks.leaks import declare_answers
from mpu_lab.labkit import profiles
from mpu_lab.perf.bandwidth import bus_factor

MIB = 1024 ** 2


# --------------------------------------------------------------------------- prediction
def ring_send_bytes(size_bytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of an array of ``size_bytes`` over ``n``
    ranks: ``n - 1`` chunks of ``size_bytes / n`` in the reduce-scatter, as many again in the
    all-gather, i.e. nccl-tests' bus factor ``2 (n - 1) / n`` of the array
    (:func:`mpu_lab.perf.bandwidth.bus_factor`)."""
    return bus_factor("all_reduce", n) * size_bytes


def _as_number(answer: Any):
    if isinstance(answer, bool):
        return None
    try:
        return float(answer)
    except (TypeError, ValueError):
        return None


def check_ring_send_bytes(answer: Any, n: int, size_mib: float, rtol: float = 0.01) -> Verdict:
    """MiB each rank sends when ``n`` ranks all-reduce ``size_mib`` MiB with the ring algorithm
    (:func:`ring_send_bytes`)."""
    if unanswered(answer, "a number of MiB"):
        return Verdict(False)
    expected = ring_send_bytes(size_mib, n)
    given = _as_number(answer)
    ok = given is not None and abs(given - expected) <= rtol * max(expected, 1e-12)
    return verdict(ok,
                   f"{expected:g} MiB: {n - 1} chunks of {size_mib:g}/{n} MiB in the "
                   f"reduce-scatter, {n - 1} more in the all-gather: 2 x ({n} - 1)/{n} x "
                   f"{size_mib:g} MiB, whatever the number of ranks, never more than twice "
                   f"the array.",
                   f"{answer!r} is not it. Hint: cut the array into n = {n} chunks. How many "
                   f"chunks does a rank pass to its neighbour while the sums travel round the "
                   f"ring, and how many while the finished chunks travel round again?")


# --------------------------------------------------------------------------- write the code
# The learner writes ``my_ring_all_reduce(x, group)``: this rank's tensor and a process group;
# it returns the sum of x over the group, built from comm.exchange.send_recv between ring
# neighbours only. Graded on every rank against mpu_lab.core.comm.all_reduce, by the collectives it
# called (none may be) and by the bytes it sent, both seen from outside
# (:mod:`~mpu_lab.labkit.c10d_calls`: every c10d collective and message, however
# the learner called it).
_P2P_NOTE = "comm.exchange.send_recv"


def ring_inputs(shape, seed: int, rank: int, device=None) -> torch.Tensor:
    """This rank's input of a case: different on every rank (from ``seed`` and the global
    ``rank``), made on the CPU so every device sees the same numbers."""
    gen = torch.Generator().manual_seed(seed * 1000 + 17 * rank + 3)
    return torch.randn(*shape, generator=gen).to(device)   # cpu: CPU generator, moved here


def _case_group(which: str):
    return (parallel_state.get_tensor_model_parallel_group() if which == "tp"
            else dist.group.WORLD)


def run_ring_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank: the learner's ring on this rank's input, against
    :func:`mpu_lab.core.comm.all_reduce`, then the collectives it called and the bytes it sent."""
    group = _case_group(case.params["group"])
    n, me = dist.get_world_size(group=group), dist.get_rank(group=group)
    shape = tuple(case.params["shape"]) if "shape" in case.params else (case.params["per_rank"] * n,)
    x = ring_inputs(shape, case.params["seed"], dist.get_rank(), initialize.get_device())
    expected = comm.all_reduce(x.clone(), group)
    with C10dCalls() as calls:
        got = learner(x.clone(), group)
    seen, sent = calls.collectives(), calls.sent_bytes()
    where = f"group rank {me} of {n}:"
    out = compare(f"{where} the sum", expected, got)
    if not out.ok:
        return out
    if seen:
        return Outcome(False, f"{where} the collectives called (the values were right)",
                       f"none: only {_P2P_NOTE} between ring neighbours", ", ".join(seen))
    chunk = math.ceil(x.numel() / n)
    ring = 2 * (n - 1) * chunk * x.element_size()
    if sent != ring:
        return Outcome(False, f"{where} the bytes this rank sent (the values were right)",
                       f"{ring} = 2 x ({n} - 1) chunks of {chunk} numbers of "
                       f"{x.element_size()} bytes, through {_P2P_NOTE}", f"{sent}")
    return Outcome(True)


RING_ALL_REDUCE = Exercise(
    name="my_ring_all_reduce",
    module="comm.py",       # saved into the learner's package once right
    run_case=run_ring_case,
    cases=[
        Case("4 numbers per rank, over the world", dict(per_rank=4, group="world", seed=1)),
        Case("a [3, 5] matrix (15 numbers: pad to a multiple of n)",
             dict(shape=[3, 5], group="world", seed=2)),
        Case("3 numbers per rank, over the tensor-parallel group",
             dict(per_rank=3, group="tp", seed=3)),
        Case("1 number (every chunk but one is padding)", dict(shape=[1], group="world", seed=4)),
    ],
    hint="n = dist.get_world_size(group), me = dist.get_rank(group); flatten x, pad it with zeros "
         "to a multiple of n and cut it into n chunks. Reduce-scatter: n - 1 times, send one "
         "chunk to (me + 1) % n, receive one from (me - 1) % n (comm.exchange.send_recv does "
         "both) and add it to your chunk of the same index; step by step the index you send "
         "moves back by one. All-gather: n - 1 more steps, passing on the finished chunks "
         "without adding. Drop the padding and give x's shape back.")


# --------------------------------------------------------------------------- answers in sight
# Lab 02's graded answers, computed by the graders above from the arguments the notebook's
# check cells pass (at the stored run's profile, labs/profiles/cpu.yaml, where a cell passes a
# parameter): tests/labs/test_no_answer_before_commit.py searches the notebook for them above
# each answer cell (mpu_lab.labkit.notebooks.leaks).
_STORED_N = profiles.values_for(profiles.load("cpu"), "02_collectives")["world_size"]
_RING_MIB = ring_send_bytes(8, _STORED_N)
declare_answers([
    ("02", "ring all-reduce MiB sent", [_RING_MIB, f"{_RING_MIB:g} MiB"], "check_ring_send_bytes("),
])
