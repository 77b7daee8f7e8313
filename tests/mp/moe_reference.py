"""A plain single-process mixture-of-experts layer, written independently of mpu_lab.core.transformer.moe:
loops over tokens and experts, no permutation, no communication, fp64.

Its weights are drawn from the seed in the order the contract states (the router's ``[E, h]``,
then for each expert 0 .. E-1 its ``[F, h]`` fc1 and ``[h, F]`` fc2, normal with the config's
init stds). Its tokens are given per rank (each rank routes, and drops, its own tokens) and
its load-balancing loss per group of ranks that route the blocks of the same sequences.
"""
import math

import torch
import torch.nn.functional as F


def master_weights(config, seed):
    """``(router [E, h], [fc1 [F, h]] * E, [fc2 [h, F]] * E)`` drawn as the contract says."""
    torch.manual_seed(seed)
    E, h, f = config.num_moe_experts, config.hidden_size, config.ffn_hidden_size
    out_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
    router = torch.empty(E, h).normal_(0.0, config.init_method_std)
    fc1, fc2 = [], []
    for _ in range(E):
        fc1.append(torch.empty(f, h).normal_(0.0, config.init_method_std))
        fc2.append(torch.empty(h, f).normal_(0.0, out_std))
    return router, fc1, fc2


def route(x, router, config):
    """``(chosen, probs)`` of one rank's tokens ``[n, h]``: ``chosen[t]`` the list of experts
    token t goes to (before dropping), ``probs[t][e]`` its weight for expert e."""
    k, fn = config.moe_router_topk, config.moe_router_score_function
    chosen, probs = [], []
    for t in range(x.shape[0]):
        logits = router @ x[t]                                    # [E]
        if fn == "sigmoid":
            order = sorted(range(len(logits)), key=lambda e: -logits.detach()[e].item())[:k]
            s = torch.sigmoid(logits[order])
            weights = s / s.sum() if k > 1 else s
        elif config.moe_router_pre_softmax:
            p = torch.softmax(logits, dim=0)
            order = sorted(range(len(logits)), key=lambda e: -p.detach()[e].item())[:k]
            weights = p[order]
        else:
            order = sorted(range(len(logits)), key=lambda e: -logits.detach()[e].item())[:k]
            weights = torch.softmax(logits[order], dim=0)
        chosen.append(order)
        probs.append(dict(zip(order, weights)))
    return chosen, probs


def keep(chosen, probs, config):
    """The (token, expert) pairs kept: with a capacity factor, each expert keeps its
    ``ceil(n k / E * cf)`` highest-probability tokens of this rank."""
    pairs = {(t, e) for t, experts in enumerate(chosen) for e in experts}
    cf = config.moe_expert_capacity_factor
    if cf is None:
        return pairs
    n, E = len(chosen), config.num_moe_experts
    capacity = math.ceil(n * config.moe_router_topk / E * cf)
    kept = set()
    for e in range(E):
        mine = sorted((t for t, x in pairs if x == e), key=lambda t: -probs[t][e].detach().item())
        kept.update((t, e) for t in mine[:capacity])
    return kept


def aux_loss(xs, router, config):
    """Switch's load-balancing loss over the tokens ``xs`` of one sequence group (all ranks
    that route blocks of the same sequences), written from the paper: E * sum_i f_i P_i."""
    x = torch.cat(xs)
    logits = x @ router.t()                                       # [T, E]
    if config.moe_router_score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        s = torch.sigmoid(logits)
        scores = s / s.sum(dim=-1, keepdim=True)
    T, E, k = x.shape[0], config.num_moe_experts, config.moe_router_topk
    counts = torch.zeros(E, dtype=x.dtype)
    for t in range(T):
        for e in torch.topk(scores[t], k).indices.tolist():
            counts[e] += 1
    f = counts / (T * k)
    P = scores.mean(dim=0)
    return config.moe_aux_loss_coeff * E * (f * P).sum()


def moe(xs, router, fc1, fc2, config, sequence_groups):
    """Outputs ``[n_r, h]`` per rank for the rank inputs ``xs`` (each ``[n_r, h]``), the kept
    pairs per rank, and the total aux loss (0 when its coefficient is 0)."""
    act = F.gelu if config.activation == "gelu" else F.relu
    outs, kept_per_rank = [], []
    for x in xs:
        chosen, probs = route(x, router, config)
        kept = keep(chosen, probs, config)
        rows = []
        for t in range(x.shape[0]):
            y = torch.zeros_like(x[t])
            for e in chosen[t]:
                if (t, e) in kept:
                    y = y + probs[t][e] * (fc2[e] @ act(fc1[e] @ x[t]))
            rows.append(y)
        outs.append(torch.stack(rows))
        kept_per_rank.append(sorted(kept))
    aux = torch.zeros((), dtype=xs[0].dtype)
    if config.moe_aux_loss_coeff > 0:
        for group in sequence_groups:
            aux = aux + aux_loss([xs[r] for r in group], router, config)
    return outs, kept_per_rank, aux
