"""Lab 09's builds (issue 42): the vocabulary-parallel ends of the model, each graded on a live
TP = 2 world against the mirror's from the same seed and, once right, saved into the learner's
package under the names the capstone (lab 18) reads (Shoeybi et al. 2019, §3, "Input and output
embedding").

* :data:`VOCAB_PARALLEL_EMBEDDING`: the class ``MyVocabParallelEmbedding(num_embeddings,
  embedding_dim, init_method, params_dtype, **unused)``, saved as
  ``my_megatron/layers.py:VocabParallelEmbedding``. Graded on: ``weight``, a Parameter holding
  this rank's ``V/t`` rows of the master table ``init_method`` draws on the CPU (the other
  dimension cut, another rank's rows, are named); the forward on ids spread over the whole
  vocabulary (the rows of ids another rank owns left in, g missing, the sum over the whole
  world, are named); its collectives (one all-reduce forward, none backward); the weight's
  gradient.
* :data:`VOCAB_PARALLEL_CROSS_ENTROPY`: ``my_vocab_parallel_cross_entropy(vocab_parallel_logits,
  target)``, the per-token loss of logits ``[b, s, V/t]`` split along the vocabulary and its
  backward, saved as ``my_megatron/cross_entropy.py:vocab_parallel_cross_entropy``. Lab 09's
  earlier exercises write the forward's arithmetic and the gradient as two plain functions;
  this one is the whole piece (an autograd Function, the vocabulary range found from the
  rank). Graded on: the loss (the mirror's, itself held to ``F.cross_entropy`` of the whole
  logits here; a slip is named by what it equals: each rank's own max, the target logit or the
  sum of exponentials not summed over the group, the whole world's sum); the forward's
  collectives (three all-reduces of one number per token, two when the target logit and the
  sum travel together; never an all-gather of the logits); the gradient of the logits for a
  random ``dL/dloss`` (softmax minus the one-hot on the owning rank only, times
  ``dL/dloss``: the one-hot subtracted on every rank and the missing ``dL/dloss`` are named),
  with no collective in backward.

Tolerances: 1e-6 (absolute and relative, fp32); the loss of the large-logit case (logits near
100, where fp32 holds a logit to about 1e-5) to 1e-4 absolute.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpu_lab.core import parallel_state, tensor_parallel
from mpu_lab.labkit.c10d_calls import C10dCalls
from mpu_lab.labkit.column_parallel.build import (INITS, counted_text, close, on_every_rank,
                                                  tp_pairs, two_tp_ranks)
from mpu_lab.labkit.grader import Case, Exercise, Outcome, compare, show
from mpu_lab.training import initialize

TOL = 1e-6


def _named(got, candidates: Sequence[Tuple[str, torch.Tensor]], atol: float = TOL) -> str:
    for meaning, value in candidates:
        if (isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(value.shape)
                and torch.allclose(got.detach().float().cpu(), value.float().cpu(), atol=atol,
                                   rtol=TOL)):
            return meaning
    return ""


def _wrong(seen: Outcome, why: str) -> Outcome:
    return Outcome(False, seen.what, seen.expected, seen.got + (f": {why}" if why else ""))


def _sum(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    out = x.detach().clone()
    dist.all_reduce(out, op=op, group=group)
    return out


# --------------------------------------------------------------------------- the embedding
def _check_table(mine, ref: torch.nn.Module, master: torch.Tensor) -> Outcome:
    t = parallel_state.get_tensor_model_parallel_world_size()
    r = parallel_state.get_tensor_model_parallel_rank()
    if not isinstance(mine, torch.nn.Module):
        return Outcome(False, "the layer", "a torch.nn.Module", type(mine).__name__)
    weight = dict(mine.named_parameters(recurse=False)).get("weight")
    if weight is None:
        return Outcome(False, "the layer's parameters", "a torch.nn.Parameter named weight "
                       "(Megatron's name: the capstone ties the output layer to it)",
                       f"parameters {sorted(dict(mine.named_parameters()))}")
    if tuple(weight.shape) != tuple(ref.weight.shape):
        v, h = master.shape
        why = ("the hidden dimension cut: each rank keeps V/t whole rows of the table (dim 0)"
               if tuple(weight.shape) == (v, h // t) else
               "the whole table: keep this rank's V/t rows" if tuple(weight.shape) == (v, h)
               else "")
        return Outcome(False, "weight's shape", f"{tuple(ref.weight.shape)}, this rank's rows "
                       f"of the [{v}, {h}] table", f"{tuple(weight.shape)}"
                       + (f": {why}" if why else ""))
    if weight.device != ref.weight.device:
        return Outcome(False, "weight's device", f"{ref.weight.device} (the rank's device)",
                       f"{weight.device}: put it on mpu_lab.core.utils.get_device()")
    if not close(weight, ref.weight):
        blocks = master.chunk(t, dim=0)
        others = [k for k in range(t) if k != r and close(weight, blocks[k])]
        why = (f"rows block {others[0]} of the table, not block {r}: this rank keeps the "
               f"vocabulary ids of its tensor-parallel rank" if others else
               "not this rank's rows of the table init_method fills after the same "
               "torch.manual_seed (the whole [V, h] table on the CPU in fp32, then the rows)")
        return Outcome(False, "weight's values", show(ref.weight), f"{show(weight)}: {why}")
    return Outcome(True)


def run_embedding_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank: the learner's embedding and the mirror's, built after the same
    seed; the table, the lookup of ids spread over the vocabulary, the collectives, the
    weight's gradient."""
    p = case.params
    kwargs = dict(init_method=INITS[p["init"]], params_dtype=torch.float32)
    rng = torch.get_rng_state()
    try:
        torch.manual_seed(p["seed"])
        ref = tensor_parallel.VocabParallelEmbedding(p["vocab"], p["hidden"],
                                                     keep_master_weight_for_test=True, **kwargs)
        torch.manual_seed(p["seed"])
        mine = learner(p["vocab"], p["hidden"], **kwargs)
    finally:
        torch.set_rng_state(rng)
    seen = _check_table(mine, ref, ref.master_weight)
    if not on_every_rank(seen.ok):
        return seen if not seen.ok else Outcome(True)

    device = initialize.get_device()
    g = torch.Generator().manual_seed(p["seed"] + 1)    # cpu: the same ids on every rank
    ids = torch.randint(0, p["vocab"], tuple(p["ids"]),
                        generator=g)        # cpu: a CPU generator, moved below
    ids.view(-1)[:2] = torch.tensor([0, p["vocab"] - 1])  # cpu: the first and last id
    ids = ids.to(device)
    out_ref = ref(ids)
    tp = parallel_state.get_tensor_model_parallel_group()
    start, end = ref.vocab_start_index, ref.vocab_end_index
    outside = (ids < start) | (ids >= end)
    rows = F.embedding((ids - start).masked_fill(outside, 0), ref.weight.detach())
    mine_only = rows.masked_fill(outside.unsqueeze(-1), 0.0)
    candidates = [("this rank's rows only: g's all-reduce over the tensor-parallel group, "
                   "which adds the other ranks' rows, is missing", mine_only),
                  ("the ids another rank owns looked up as row 0 of this rank's table and "
                   "left in: zero their rows before g", _sum(rows, tp)),
                  ("the ids another rank owns looked up as this rank's first or last row and "
                   "left in: zero their rows before g", _sum(F.embedding(
                       (ids - start).clamp(0, end - start - 1), ref.weight.detach()), tp)),
                  (f"summed over the whole world of {dist.get_world_size()} ranks: use the "
                   f"tensor-parallel group", _sum(mine_only, None))]
    with C10dCalls() as calls:
        out = mine(ids)
    seen = compare("the embedding of the ids", out_ref, out, atol=TOL, rtol=TOL)
    if not seen.ok:
        seen = _wrong(seen, _named(out, candidates))
    elif calls.collectives() != ["all-reduce"]:
        seen = Outcome(False, "the collectives of forward (the values were right)",
                       "1 all-reduce (g)", counted_text(calls.collectives()))
    elif not out.requires_grad:
        seen = Outcome(False, "the output", "a tensor autograd can differentiate",
                       "no gradient reaches weight")
    if not on_every_rank(seen.ok):
        return seen if not seen.ok else Outcome(True)
    dy = torch.randn(tuple(out_ref.shape), generator=g).to(device)  # cpu: then moved
    out_ref.backward(dy)
    with C10dCalls() as calls:
        out.backward(dy)
    weight = dict(mine.named_parameters(recurse=False))["weight"]
    seen = compare("weight.grad", ref.weight.grad, weight.grad, atol=TOL, rtol=TOL)
    if seen.ok and calls.collectives():
        seen = Outcome(False, "the collectives of backward (the values were right)",
                       "none: g's backward is the identity", counted_text(calls.collectives()))
    return seen


VOCAB_PARALLEL_EMBEDDING = Exercise(
    name="MyVocabParallelEmbedding",
    run_case=run_embedding_case,
    cases=[Case("V 8, h 4, ids [2, 5]", dict(vocab=8, hidden=4, ids=[2, 5], seed=1,
                                            init="normal_(std=0.02)")),
           Case("V 12, h 6, ids [3, 4], xavier_normal_", dict(vocab=12, hidden=6, ids=[3, 4],
                                                              seed=2, init="xavier_normal_")),
           Case("V 4, h 2, ids [1, 9]", dict(vocab=4, hidden=2, ids=[1, 9], seed=3,
                                            init="normal_(std=0.02)"))],
    hint=("__init__: draw the whole [num_embeddings, embedding_dim] table with init_method (on "
          "the CPU, in fp32: the same numbers on every rank), keep this tensor-parallel rank's "
          "V/t rows as the Parameter weight on the rank's device, and remember the range "
          "[start, end) of ids they hold. forward(ids): look up the ids in range (others as row "
          "0), zero the rows of ids out of range, then g "
          "(reduce_from_tensor_model_parallel_region)."),
    ranks_needed=two_tp_ranks,
    layout=tp_pairs,
    module="layers.py",
    saves_as=("VocabParallelEmbedding",),
)


# --------------------------------------------------------------------------- the loss
def _logits(p: dict, t: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The whole logits ``[b, s, V]`` and targets ``[b, s]`` of a case, the same on every
    tensor-parallel rank of a replica, different across data-parallel replicas (CPU)."""
    b, s, per = p["b"], p["s"], p["vocab_per_rank"]
    vocab = per * t
    g = torch.Generator().manual_seed(p["seed"] + 100 * parallel_state.get_data_parallel_rank())
    logits = p.get("offset", 0.0) + p.get("scale", 3.0) * torch.randn(
        b, s, vocab, generator=g)              # cpu: a CPU generator; the case moves them
    if p["targets"] == "first_shard":
        target = torch.randint(0, per, (b, s), generator=g)  # cpu: the same CPU generator
    elif p["targets"] == "last":
        target = torch.full((b, s), vocab - 1)  # cpu: moved with the logits
        target.view(-1)[::2] = 0
    else:
        target = torch.randint(0, vocab, (b, s), generator=g)  # cpu: the same CPU generator
    return logits, target


def _ce_candidates(shard: torch.Tensor, target: torch.Tensor, start: int,
                   end: int) -> List[Tuple[str, torch.Tensor]]:
    """Losses some slips give, worked out here on this rank's slice."""
    tp = parallel_state.get_tensor_model_parallel_group()
    x = shard.detach()
    mine = (target >= start) & (target < end)
    local = (target - start).masked_fill(~mine, 0)
    pick = lambda z: z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
    m = _sum(x.max(dim=-1).values, tp, dist.ReduceOp.MAX)
    z = x - m.unsqueeze(-1)
    right_sum, right_pick = _sum(z.exp().sum(-1), tp), _sum(pick(z), tp)
    own = x - x.max(dim=-1, keepdim=True).values
    zw = x - _sum(x.max(dim=-1).values, None, dist.ReduceOp.MAX).unsqueeze(-1)
    world = _sum(zw.exp().sum(-1), None).log() - _sum(pick(zw), None)
    return [("each rank subtracted its own max: all-reduce the max (MAX) over the group first",
             _sum(own.exp().sum(-1), tp).log() - _sum(pick(own), tp)),
            ("the target logit was not summed over the group: only the rank that owns the "
             "target holds it", right_sum.log() - pick(z)),
            ("the sum of exponentials was not summed over the group: the log-sum-exp of this "
             "rank's slice only", z.exp().sum(-1).log() - right_pick),
            (f"summed over the whole world of {dist.get_world_size()} ranks: use the "
             f"tensor-parallel group", world)]


def run_cross_entropy_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank: this rank's vocabulary slice of the case's logits, the learner's
    loss and its gradient against the mirror's (held to ``F.cross_entropy`` first)."""
    p = case.params
    device = initialize.get_device()
    t = parallel_state.get_tensor_model_parallel_world_size()
    r = parallel_state.get_tensor_model_parallel_rank()
    full, target = _logits(p, t)
    per = p["vocab_per_rank"]
    start, end = r * per, (r + 1) * per
    shard = full[..., start:end].contiguous().to(device)
    target = target.to(device)
    ref_in = shard.clone().requires_grad_()
    loss_ref = tensor_parallel.vocab_parallel_cross_entropy(ref_in, target)
    dense = F.cross_entropy(full.reshape(-1, per * t), target.reshape(-1).cpu(),
                            reduction="none").view_as(target)
    if not compare("reference", dense, loss_ref, atol=1e-4).ok:
        raise RuntimeError(f"mpu_lab's vocab_parallel_cross_entropy {show(loss_ref)} disagrees "
                           f"with F.cross_entropy of the whole logits {show(dense)}")
    atol = p.get("atol", TOL)
    candidates = _ce_candidates(shard, target, start, end)
    mine_in = shard.clone().requires_grad_()
    with C10dCalls() as calls:
        loss = learner(mine_in, target)
    what = (f"the loss (targets {target.view(-1).tolist()}, ids [{start}, {end}) on this rank, "
            f"logits {list(shard.shape)})")
    seen = compare(what, loss_ref, loss, atol=atol, rtol=TOL)
    if not seen.ok and isinstance(loss, torch.Tensor):
        why = _named(loss, candidates, atol)
        if not why and not bool(loss.isfinite().all()):
            why = ("not finite: exp overflowed; subtract the group's max (an all-reduce MAX) "
                   "before exp")
        seen = _wrong(seen, why)
    kinds = calls.collectives()
    if seen.ok and ("all-gather" in kinds or not 2 <= kinds.count("all-reduce") <= 3
                    or len(kinds) != kinds.count("all-reduce")):
        seen = Outcome(False, "the collectives of forward (the values were right)",
                       "3 all-reduces of one number per token (max, target logit, sum of "
                       "exponentials; 2 when the last two travel together)", counted_text(kinds)
                       + (": the all-gather moves every logit, V/t numbers per token"
                          if "all-gather" in kinds else ""))
    if seen.ok and not loss.requires_grad:
        seen = Outcome(False, "the loss", "a tensor autograd can differentiate (apply an "
                       "autograd Function)", "no gradient reaches the logits")
    if not on_every_rank(seen.ok):
        return seen if not seen.ok else Outcome(True)

    g = torch.Generator().manual_seed(p["seed"] + 7)
    dloss = (0.5 + torch.rand(tuple(target.shape), generator=g)).to(device)  # cpu: then moved
    loss_ref.backward(dloss)
    with C10dCalls() as calls:
        loss.backward(dloss)
    seen = compare("the gradient of the logits (this rank's slice)", ref_in.grad, mine_in.grad,
                   atol=TOL, rtol=TOL)
    if not seen.ok and isinstance(mine_in.grad, torch.Tensor):
        soft = torch.softmax(full.to(device), dim=-1)[..., start:end]
        mine = (target >= start) & (target < end)
        local = (target - start).masked_fill(~mine, 0)       # as Megatron masks it
        onehot = torch.zeros_like(soft).scatter_(-1, local.unsqueeze(-1), 1.0)
        owned = mine.unsqueeze(-1).to(soft.dtype)
        seen = _wrong(seen, _named(mine_in.grad, [
            ("the one-hot subtracted on every rank: only the rank that owns the target "
             "subtracts its 1", (soft - onehot) * dloss.unsqueeze(-1)),
            ("softmax minus one-hot, not multiplied by dL/dloss (backward's grad_output)",
             soft - onehot * owned),
            ("the softmax alone: the one-hot of the target is not subtracted",
             soft * dloss.unsqueeze(-1))]))
    if seen.ok and calls.collectives():
        seen = Outcome(False, "the collectives of backward (the values were right)",
                       "none: forward's all-reduces already made each rank's softmax slice "
                       "global", counted_text(calls.collectives()))
    return seen


VOCAB_PARALLEL_CROSS_ENTROPY = Exercise(
    name="my_vocab_parallel_cross_entropy",
    run_case=run_cross_entropy_case,
    cases=[Case("logits [2, 3, 5] per rank, targets all in rank 0's slice",
                dict(b=2, s=3, vocab_per_rank=5, targets="first_shard", seed=1)),
           Case("logits [2, 4, 6] per rank, targets anywhere",
                dict(b=2, s=4, vocab_per_rank=6, targets="spread", seed=2)),
           Case("the first and the last vocabulary id, logits [1, 4, 3] per rank",
                dict(b=1, s=4, vocab_per_rank=3, targets="last", seed=3)),
           Case("large logits near 100 (exp overflows without the max), [2, 2, 4] per rank",
                dict(b=2, s=2, vocab_per_rank=4, targets="spread", seed=4, offset=100.0,
                     scale=5.0, atol=1e-4))],
    hint=("an autograd Function (defined inside the function). forward: this rank's ids are "
          "[rank * V/t, (rank + 1) * V/t); all-reduce (MAX) each token's max and subtract it; "
          "the target's logit where this rank owns the target, 0 elsewhere, all-reduce (SUM); "
          "the sum of exp, all-reduce (SUM); loss = log(sum) - target logit; keep the softmax "
          "slice. backward: (softmax - one-hot on the owning rank only) * grad_output, no "
          "communication. Every all-reduce over parallel_state.get_tensor_model_parallel_group()."),
    ranks_needed=two_tp_ranks,
    layout=tp_pairs,
    module="cross_entropy.py",
    saves_as=("vocab_parallel_cross_entropy",),
)
