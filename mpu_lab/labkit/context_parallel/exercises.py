"""Lab 10's write-the-code exercises, graded on a live world whose ranks form one CP group
(every rank of the world: ``cp`` = the world size).

* :data:`LSE_MERGE` — ``my_merge(out_a, lse_a, out_b, lse_b)``: fold the attention of the same
  queries over a second block of keys into the first (the log-sum-exp rule). The grader runs a
  real ring on the world, the mirror's blocks and messages with the learner's merge, and
  compares every rank's output and log-sum-exp with dense causal attention over the whole
  sequence; one input has scores large enough that ``exp`` overflows fp32.
* :data:`ZIGZAG_LAYOUT` — ``my_zigzag(tokens, group)``: this CP rank's part of a ``[b, s]``
  tensor in Megatron's layout (chunks ``r`` and ``2cp-1-r`` of ``2cp``), compared with the
  mirror's ``get_batch_on_this_cp_rank``.
* :func:`check_last_rank_share` — the prediction of §3: the last rank's share of the causal
  work under a contiguous split.
"""
from __future__ import annotations

import fractions
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mpu_lab.core import context_parallel
from mpu_lab.training import initialize
from mpu_lab.core.comm import exchange
from mpu_lab.core.context_parallel.block_attention import block_forward
from mpu_lab.core.context_parallel.ring_attention import block_pair
from mpu_lab.labkit.context_parallel.lessons import attention_inputs, causal_work, dense_lse
from mpu_lab.labkit.verdict import Verdict, unanswered, verdict
from mpu_lab.labkit.grader import Case, Exercise, Outcome, compare
from mpu_lab.labkit.notebooks import leaks


def _two_ranks_or_more(world_size: int, tp: int, pp: int) -> Optional[str]:
    return None if world_size >= 2 else f"it needs 2 ranks or more, this world has {world_size}"


# --------------------------------------------------------------------------- the merge
def ring_forward(merge: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group):
    """Ring attention's forward over ``group`` (the mirror's block pairs and ring messages,
    causal, zig-zag layout) with ``merge`` folding each step's block into the running
    ``(out [s/cp, b, n, d], lse [b, n, s/cp])``."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk, scale = q.size(0) // 2, q.size(-1) ** -0.5
    kv = torch.stack([k, v])
    out = lse = None
    for step in range(cp):
        kv_rank = (rank - step) % cp
        rows, cols, diagonal = block_pair(kv_rank, rank, True, chunk)
        block_out, block_lse = block_forward(q[rows], kv[0, cols], kv[1, cols], diagonal, scale)
        if out is None:
            out, lse = block_out, block_lse
        else:
            merged = merge(out[rows], lse[..., rows], block_out, block_lse)
            if not (isinstance(merged, tuple) and len(merged) == 2):
                return merged, None
            out, lse = out.clone(), lse.clone()
            out[rows], lse[..., rows] = merged
        if step + 1 < cp:
            kv = exchange.send_recv(kv, (rank + 1) % cp, (rank - 1) % cp, group)
    return out, lse


def run_merge_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank: the ring with the learner's merge, against dense causal attention
    (SDPA over the whole sequence) and the dense log-sum-exp, at this rank's positions."""
    group = dist.group.WORLD
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    p = case.params
    seq_length = 2 * cp * p["chunk"]
    q, k, v = attention_inputs(seq_length, p["b"], p["n"], p["d"], p["seed"], p.get("scale_q", 1.0),
                               device=initialize.get_device())
    mine = context_parallel.positions_on_rank(seq_length, rank, cp)
    dense = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True).permute(2, 0, 1, 3)
    out, lse = ring_forward(learner, q[mine], k[mine], v[mine], group)
    if lse is None:
        return Outcome(False, "what my_merge returned", "a pair (out, lse)",
                       f"{type(out).__name__}")
    where = f"CP rank {rank} of {cp}, positions {mine}:"
    result = compare(f"{where} the attention output after the last ring step", dense[mine], out,
                     atol=1e-5)
    if not result.ok:
        return result
    return compare(f"{where} the log-sum-exp after the last ring step",
                   dense_lse(q, k, p["d"] ** -0.5)[..., mine], lse, atol=1e-5)


LSE_MERGE = Exercise(
    name="my_merge",
    module="context_parallel.py",       # saved into the learner's package once right
    run_case=run_merge_case,
    cases=[
        Case("1 sequence, 1 head, chunks of 1 token", dict(chunk=1, b=1, n=1, d=4, seed=1)),
        Case("2 sequences, 2 heads, chunks of 3 tokens", dict(chunk=3, b=2, n=2, d=4, seed=2)),
        Case("large scores: exp(score) overflows fp32", dict(chunk=2, b=1, n=2, d=4, seed=3,
                                                              scale_q=60.0)),
    ],
    hint="each block's output is already normalised by its own sum of exponentials, exp(lse). "
         "The merged sum is exp(lse_a) + exp(lse_b), so the merged lse is their log-add-exp, and "
         "each output is weighted by its share of that sum, exp(lse_x - lse); never take exp "
         "of an lse on its own (it overflows). lse is [b, n, sq] and out [sq, b, n, d]: line "
         "the weights up with the output's rows.",
    ranks_needed=_two_ranks_or_more)


# --------------------------------------------------------------------------- the layout
def layout_input(b: int, seq_length: int, kind: str, seed: int, device=None) -> torch.Tensor:
    """A ``[b, s]`` batch tensor, the same on every rank: token ids (``"tokens"``: distinct
    integers, so a wrong position shows) or a float mask-like tensor (``"floats"``)."""
    if kind == "tokens":
        ids = torch.arange(b * seq_length, device=device)
        return ids.view(b, seq_length) * 7 + seed
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(b, seq_length, generator=gen, device="cpu").to(device)  # cpu: a CPU generator


def run_zigzag_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank: the learner's part of the batch against the mirror's
    ``get_batch_on_this_cp_rank`` over the same group."""
    group = dist.group.WORLD
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    p = case.params
    seq_length = 2 * cp * p["chunk"]
    tokens = layout_input(p["b"], seq_length, p["kind"], p["seed"], initialize.get_device())
    expected = context_parallel.get_batch_on_this_cp_rank({"tokens": tokens},
                                                          cp_group=group)["tokens"]
    got = learner(tokens.clone(), group)
    return compare(f"CP rank {rank} of {cp}, s = {seq_length}: this rank's tokens", expected, got,
                   atol=0.0, rtol=0.0)


ZIGZAG_LAYOUT = Exercise(
    name="my_zigzag",
    run_case=run_zigzag_case,
    cases=[
        Case("1 sequence, chunks of 1 token", dict(chunk=1, b=1, kind="tokens", seed=0)),
        Case("2 sequences, chunks of 3 tokens", dict(chunk=3, b=2, kind="tokens", seed=5)),
        Case("a float [b, s] tensor (a loss mask)", dict(chunk=2, b=3, kind="floats", seed=9)),
    ],
    hint="cut the sequence dim (dim 1) into 2*cp equal chunks; rank r keeps chunk r, then "
         "chunk 2*cp-1-r, concatenated in that order. cp and r come from the group "
         "(dist.get_world_size(group), dist.get_rank(group)), not from the world.",
    ranks_needed=_two_ranks_or_more)


# --------------------------------------------------------------------------- the prediction
def last_rank_share(cp: int) -> float:
    """The last of ``cp`` contiguous slices' share of the causal (query, key) pairs, for a long
    sequence: ``(2cp - 1) / cp**2`` (its queries see on average ``(2cp - 1)/(2cp)`` of the
    sequence; all queries together ``1/2`` of it)."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive integer, got {cp!r}")
    return (2 * cp - 1) / cp ** 2


def check_last_rank_share(answer: Any, cp: int, atol: float = 0.01) -> Verdict:
    """The share (a fraction, or a percentage above 1) of the causal work the last of ``cp``
    ranks gets under a contiguous split of a long sequence (:func:`last_rank_share`)."""
    if unanswered(answer, "a fraction, e.g. 0.25"):
        return Verdict(False)
    expected = last_rank_share(cp)
    try:
        given = float(answer)
    except (TypeError, ValueError):
        given = None
    if given is not None and given > 1:
        given /= 100
    s = 64 * cp
    counted = causal_work(s, cp, "contiguous")
    return verdict(given is not None and abs(given - expected) <= atol,
                   f"(2cp - 1)/cp^2 = {expected:.4f} for a long sequence, against a fair "
                   f"{1 / cp:.4f} (counted at s = {s}: {counted[-1] / sum(counted):.4f}).",
                   f"{answer!r} is not it. Hint: the last slice holds positions from "
                   f"(cp-1)s/cp to s; a query at p sees p + 1 keys; all queries together see "
                   f"about s^2/2 pairs.")


# --------------------------------------------------------------------------- answers
# What the lab's graded question answers, for the leak check (mpu_lab.labkit.notebooks.leaks):
# the last rank's share at cp = 4 as lab 10 asks it, 7/16.
leaks.declare_answers([
    ("10", "last rank share", [fractions.Fraction(last_rank_share(4)).limit_denominator(1000)],
     "check_last_rank_share("),
])
