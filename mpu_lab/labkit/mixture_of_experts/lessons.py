"""Lab 13's lessons: mixture of experts and expert parallelism, from the mirror's own pieces.

Kernel side (pure, no processes):

* :func:`why_moe_rows` — parameters against FLOPs per token as E grows at fixed k (the cost
  model's :mod:`~mpu_lab.perf.cost_model.moe`, on Mixtral 8x7B's shape);
* :func:`capacity_demo` — expert capacity and the tokens dropped beyond it (the mirror's
  ``get_capacity`` and ``apply_router_token_dropping``, Switch Transformers §2.2);
* :func:`expert_groups_in_dense` — each expert group inside a dense data(+context)-parallel
  group: why the ep mesh is a factoring of the dp mesh, and
  :func:`answer_why_ep_divides_dp`, the course's answer, shown once the learner wrote theirs;
* :func:`dispatch_bytes` — bytes a rank receives in one dispatch, all-to-all against
  all-gather, and which is smaller.

Rank side (inside a playground world's ranks, with Megatron's expert groups made):

* :func:`named_tokens`, :func:`names` — tokens whose rows carry their name
  (``100 * rank + token``), printed block by block;
* :func:`alltoall_dispatcher` — the mirror's dispatcher for this world's expert groups;
* :func:`train_load` — a small MoE layer trained for a few steps with or without the
  load-balancing loss, the load of its busiest expert recorded at every step;
* :func:`count_dispatch_bytes` — one MoE layer's forward and backward under
  :class:`~mpu_lab.perf.comm_counts.CollectiveLog` (torch's ``CommDebugMode``): the bytes of
  its all-to-alls, against the formula from the split sizes.
"""
from __future__ import annotations

import math
import textwrap
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from mpu_lab.core import comm, parallel_state
from mpu_lab.training import initialize
from mpu_lab.labkit.mixture_of_experts.exercises import case_inputs
from mpu_lab.core.distributed import allreduce_data_parallel_grads
from mpu_lab.core.transformer import TransformerConfig
from mpu_lab.core.transformer.moe import (
    MoEAlltoAllTokenDispatcher, MoELayer, apply_router_token_dropping, get_capacity,
    topk_routing_with_score_function)
from mpu_lab.perf.comm_counts import CollectiveLog
from mpu_lab.perf.cost_model.moe import (MIXTRAL_8X7B, MoEModelShape, moe_flops_per_token,
                                         moe_parameter_count)
from mpu_lab.core.parallel_state import generate_rank_groups


# --------------------------------------------------------------------------- why MoE
def why_moe_rows(model: MoEModelShape = MIXTRAL_8X7B,
                 experts: Sequence[int] = (1, 2, 4, 8, 16, 64)) -> List[Dict[str, float]]:
    """For each ``E`` in ``experts`` (top-k = min(model's k, E)): total and active parameters
    and forward FLOPs per token of ``model`` with E experts per layer."""
    rows = []
    for e in experts:
        shape = MoEModelShape(**{**model.__dict__, "num_experts": e, "top_k": min(model.k, e)})
        n, f = moe_parameter_count(shape), moe_flops_per_token(shape)
        rows.append(dict(experts=e, topk=shape.k, total=n["total"], active=n["active"],
                         flops=f["total"]))
    return rows


def print_why_moe(rows: List[Dict[str, float]], model: MoEModelShape = MIXTRAL_8X7B) -> None:
    print(f"{model.name or 'model'} with E experts per layer, top-k = min({model.k}, E)")
    print(f"{'E':>4} {'k':>3} {'parameters':>12} {'used per token':>15} {'GFLOP per token':>16}")
    for r in rows:
        print(f"{r['experts']:>4} {r['topk']:>3} {r['total'] / 1e9:>10.1f} B {r['active'] / 1e9:>13.1f} B "
              f"{r['flops'] / 1e9:>16.1f}")


# --------------------------------------------------------------------------- capacity
def capacity_demo(num_tokens: int = 32, num_experts: int = 4, topk: int = 1,
                  capacity_factor: float = 1.0, popular: float = 1.5,
                  seed: int = 0) -> Dict[str, object]:
    """One rank's tokens routed (softmax over all experts, then top-k), with expert 0 made
    ``popular`` (its logit raised), then the capacity applied: ``capacity`` (Switch:
    ``ceil(T * k / E * factor)``), tokens per expert ``before`` and ``kept``, ``dropped``."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)  # cpu: CPU generator
    logits[:, 0] += popular
    probs, routing_map = topk_routing_with_score_function(logits, topk, use_pre_softmax=True)
    kept_probs, kept_map = apply_router_token_dropping(probs, routing_map, topk, capacity_factor)
    before = routing_map.sum(dim=0).tolist()
    kept = kept_map.sum(dim=0).tolist()
    return dict(capacity=get_capacity(num_tokens * topk, num_experts, capacity_factor),
                before=before, kept=kept, dropped=sum(before) - sum(kept),
                routing_map=routing_map, kept_map=kept_map, probs=probs)


# --------------------------------------------------------------------------- expert groups
def expert_groups_in_dense(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1,
                           ep: int = 2) -> List[Tuple[List[int], List[int], List[int]]]:
    """For each expert-parallel group (expert-tensor-parallel size = t): ``(ep group, the dense
    data+context-parallel group that holds it, the expert-data-parallel groups of the same
    ranks)``. Raises ``ValueError`` if an ep group is in no single dense dp-cp group."""
    groups = generate_rank_groups(world_size, tp, pp, cp, expert_model_parallel_size=ep)
    out = []
    for ep_group in groups["ep"]:
        homes = [g for g in groups["dp-cp"] if set(ep_group) <= set(g)]
        if len(homes) != 1:
            raise ValueError(f"ep group {ep_group} is not inside one dp-cp group")
        edp = [g for g in groups["expert-dp"] if set(g) & set(ep_group)]
        out.append((ep_group, homes[0], edp))
    return out


def answer_why_ep_divides_dp(my_answer: str, world_size: int, tp: int = 1, pp: int = 1,
                             ep: int = 2) -> None:
    """The course's answer to "why is the expert-parallel mesh a factoring of the
    data-parallel mesh, not a dimension of its own?", printed only once ``my_answer`` holds
    the learner's own (a question in words has no check: writing one down is the commitment).
    The sizes come from Megatron's groups for ``world_size``, ``tp``, ``pp`` and ``ep``."""
    if not str(my_answer or "").strip():
        print('No answer yet: write yours in my_answer = "...", then run this cell again.')
        return
    groups = generate_rank_groups(world_size, tp, pp, expert_model_parallel_size=ep)
    d, edp = len(groups["dp"][0]), len(groups["expert-dp"][0])
    expert_ranks = tp * edp
    text = (
        f"In a dense model the MLP is replicated over the data-parallel (and context-parallel) "
        f"ranks: each replica holds the same weights and sees other tokens. An MoE layer "
        f"replaces the MLP, so those replicas are exactly the ranks among which the experts "
        f"can be divided instead of copied: split the experts over ep of them and keep "
        f"d*c/ep copies of each (the expert-data-parallel group, which averages the experts' "
        f"gradients). Here d = {d}, ep = {ep}: ep x edp = {ep} x {edp} = d*c. Each copy is "
        f"split over etp = t = {tp} ranks, so an expert lives on etp x edp = {expert_ranks} "
        f"ranks. A dimension of its own would multiply the GPUs of the attention layers, "
        f"which have nothing to split among the experts' ranks; as a factor of d it costs "
        f"no GPUs: the same ranks run the dense layers data-parallel and the expert layers "
        f"expert-parallel. In Megatron's expert generator ep takes the stride that cp has in "
        f"the dense one, so with cp > 1 an ep group may span context-parallel ranks too (the "
        f"tokens of one sequence are still routed independently).")
    print("Our answer:\n" + textwrap.fill(text, 96))


# --------------------------------------------------------------------------- bytes
def dispatch_bytes(tokens: int, hidden: int, topk: int, ep: int,
                   dtype_bytes: int = 2) -> Dict[str, float]:
    """Bytes one rank receives from the other ranks in one dispatch (forward, tokens only),
    balanced routing: all-to-all ``T k h B (ep-1)/ep`` (each of its ``T k`` rows goes to the
    rank of its expert, which is another rank ``(ep-1)/ep`` of the time); all-gather ``(ep-1)
    T h B`` (every other rank's ``T`` tokens, whichever expert they chose). The ratio is
    ``ep / k``: the all-gather moves less only when ``k >= ep``."""
    a2a = tokens * topk * hidden * dtype_bytes * (ep - 1) / ep
    allgather = (ep - 1) * tokens * hidden * dtype_bytes
    return dict(alltoall=float(a2a), allgather=float(allgather),
                smaller="alltoall" if a2a < allgather else "allgather" if allgather < a2a
                else "same")


# --------------------------------------------------------------------------- rank side
def named_tokens(num_tokens: int, num_experts: int, topk: int, seed: int = 0):
    """This rank's ``(tokens [T, 2], routing_map [T, E])``: row ``t`` named ``100 rank + t``
    (:func:`mpu_lab.labkit.mixture_of_experts.exercises.case_inputs`)."""
    rank = torch.distributed.get_rank()
    return case_inputs(rank, num_tokens, num_experts, topk, seed,
                       device=initialize.get_device())


def names(rows: torch.Tensor, sizes: Optional[Sequence[int]] = None) -> str:
    """Rows by their name (first column), ``sizes`` blocks separated by ``|``."""
    ids = [f"{v:g}" for v in rows[:, 0].detach().float().cpu().tolist()]
    if sizes is None:
        return "[" + " ".join(ids) + "]"
    blocks, start = [], 0
    for n in sizes:
        blocks.append(" ".join(ids[start:start + int(n)]) or "-")
        start += int(n)
    return "[" + " | ".join(blocks) + "]"


def choices(routing_map: torch.Tensor) -> str:
    """Each token's experts, e.g. ``t0->e1,e3  t1->e0``."""
    return "  ".join(f"t{t}->" + ",".join(f"e{e}" for e in row.nonzero().flatten().tolist())
                     for t, row in enumerate(routing_map.cpu()))


class _Config:
    """What the dispatcher reads from a config: the number of experts."""

    def __init__(self, num_moe_experts: int):
        self.num_moe_experts = num_moe_experts


def alltoall_dispatcher(num_experts: int) -> MoEAlltoAllTokenDispatcher:
    """The mirror's all-to-all dispatcher for this rank's experts under the current groups."""
    ep = parallel_state.get_expert_model_parallel_world_size()
    local = num_experts // ep
    first = parallel_state.get_expert_model_parallel_rank() * local
    return MoEAlltoAllTokenDispatcher(local, list(range(first, first + local)),
                                      _Config(num_experts))


def _moe_config(hidden: int, num_experts: int, topk: int, aux_loss: float = 0.0,
                dispatcher: str = "alltoall") -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1,
                             ffn_hidden_size=2 * hidden, num_moe_experts=num_experts,
                             moe_router_topk=topk, moe_aux_loss_coeff=aux_loss,
                             moe_token_dispatcher_type=dispatcher,
                             moe_router_pre_softmax=topk == 1)


def train_load(aux_loss: float, steps: int = 40, tokens: int = 64, hidden: int = 16,
               num_experts: int = 8, topk: int = 2, clusters: int = 16, lr: float = 0.05,
               seed: int = 0) -> List[float]:
    """Train one MoE layer (every rank of the expert-parallel group a share of the batch) to
    copy a fixed random MLP on clustered inputs, with Adam, ``steps`` steps; return the load
    of the busiest expert over the mean load (1: balanced; at most ``E / k``) of the whole
    batch before each step, the same list on every rank. Single-threaded, so the numbers do
    not depend on the core count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        device = initialize.get_device()
        torch.manual_seed(seed)
        layer = MoELayer(_moe_config(hidden, num_experts, topk, aux_loss))
        teacher = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.Tanh(),
                                      torch.nn.Linear(4 * hidden, hidden)).to(device)
        gen = torch.Generator().manual_seed(seed + 1)
        centres = 2 * torch.randn(clusters, hidden, generator=gen)  # cpu: CPU generator
        gen.manual_seed(seed + 2 + torch.distributed.get_rank())
        optimizer = torch.optim.Adam(layer.parameters(), lr=lr)
        group = parallel_state.get_expert_model_parallel_group()
        loads = []
        for _ in range(steps):
            which = torch.randint(0, clusters, (tokens,), generator=gen)  # cpu: CPU generator
            x = (centres[which] + 0.3 * torch.randn(tokens, hidden, generator=gen))  # cpu: CPU generator
            x = x.unsqueeze(1).to(device)                                   # [s, b=1, h]
            with torch.no_grad():
                target = teacher(x)
            output, _ = layer(x)
            counts = layer.token_dispatcher.num_global_tokens_per_local_expert.sum(dim=0)
            counts = comm.all_gather(counts.float().to(device), group=group)   # [E]
            loads.append(round(float(counts.max() / counts.mean()), 6))
            loss = ((output - target) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            allreduce_data_parallel_grads(list(layer.parameters()))
            optimizer.step()
        return loads
    finally:
        torch.set_num_threads(threads)


def count_dispatch_bytes(tokens: int = 16, hidden: int = 8, num_experts: int = 8,
                         topk: int = 2, dispatcher: str = "alltoall",
                         seed: int = 0) -> Dict[str, object]:
    """One MoE layer's forward and backward on this rank's ``tokens`` under
    :class:`~mpu_lab.perf.comm_counts.CollectiveLog`: this rank's bytes of each collective
    kind in each pass (``measured``), and the all-to-all dispatcher's formula from its split
    sizes (``formula``: forward, the counts ``E`` int64s, then ``T k`` rows of ``h`` floats and
    ``T k`` probabilities out, ``T k`` rows back in the combine; backward, the reverse of the
    three row exchanges), with ``rows_to_others``: the rows this rank sends off-rank."""
    device = initialize.get_device()
    torch.manual_seed(seed)
    layer = MoELayer(_moe_config(hidden, num_experts, topk, dispatcher=dispatcher))
    gen = torch.Generator().manual_seed(seed + 1 + torch.distributed.get_rank())
    x = torch.randn(tokens, 1, hidden, generator=gen).to(device).requires_grad_(True)  # cpu: CPU generator
    with CollectiveLog() as log:
        output, _ = layer(x)
        output.sum().backward()
    measured: Dict[str, int] = {}
    for e in log.events:
        key = f"{e['kind']} {'backward' if e['backward'] else 'forward'}"
        measured[key] = measured.get(key, 0) + e["bytes"]
    out = {"measured": measured, "events": len(log.events)}
    if dispatcher == "alltoall":
        d = layer.token_dispatcher
        rows, me = sum(d.input_splits), parallel_state.get_expert_model_parallel_rank()
        four = x.element_size()
        out["formula"] = {
            "all_to_all forward": num_experts * 8 + rows * hidden * four + rows * four
            + sum(d.output_splits) * hidden * four,
            "all_to_all backward": sum(d.output_splits) * hidden * four
            + sum(d.output_splits) * four + rows * hidden * four}
        out["rows"] = rows
        out["rows_to_others"] = rows - d.input_splits[me]
    return out


# Lab 13's reading of the two load curves, printed by the cell that runs them (stored empty):
# in the notebook's prose it would answer "shrink, stay, or grow?" before the learner decides.
def load_reading(loads: Dict[str, Sequence[float]], window: int = 10) -> str:
    """What the load curves of :func:`train_load` show, read from the numbers printed: per
    curve the busiest expert over the mean in the first and the last ``window`` steps and
    whether it grew, stayed or shrank (5 % either way); then why, for what this run showed.
    ``loads``: ``{"aux loss 0.0": [...], "aux loss 0.1": [...]}``, without the loss first."""
    lines, trend = [], {}
    for label, curve in loads.items():
        first, last = imbalance_summary(list(curve)[:window], window), imbalance_summary(curve,
                                                                                        window)
        trend[label] = ("grew" if last > 1.05 * first else "shrank" if last < first / 1.05
                        else "stayed about the same")
        lines.append(f"{label}: busiest expert / mean, first {window} steps {first}, last "
                     f"{window} {last}: it {trend[label]}")
    (without, curve_without), (_, curve_with) = list(loads.items())[:2]
    if trend[without] == "grew":
        lines.append("Without the loss nothing held the router back: the experts chosen early "
                     "got the gradient,\nimproved, and were chosen more (the rich get richer).")
    else:
        lines.append(f"Without the loss the imbalance {trend[without]} in this run: nothing "
                     f"pushes it down, but\nthese {len(curve_without)} steps did not make the "
                     f"rich richer.")
    if imbalance_summary(curve_with, window) < imbalance_summary(curve_without, window):
        lines.append("With the loss the router was pushed towards an even load.")
    else:
        lines.append("With the loss the last steps were no more even than without it in this "
                     "run.")
    return "\n".join(lines)


def imbalance_summary(loads: Sequence[float], last: int = 10) -> float:
    """The mean of the last ``last`` loads, to one decimal (what survives another CPU)."""
    tail = list(loads)[-last:]
    return round(sum(tail) / len(tail), 1) if tail else math.nan


def format_byte_counts(measured: Dict[str, int], direction: str = "") -> str:
    """``{"all_to_all forward": 2240, ...}`` as ``all_to_all forward 2,240 B, ...`` (only the
    keys ending in ``direction`` when given), in the order counted."""
    return ", ".join(f"{name} {count:,} B" for name, count in measured.items()
                     if name.endswith(direction))
