"""torchrun worker: mpu_lab.core.transformer.moe.MoELayer on 4 or 8 ranks against the plain single-process
MoE of tests/mp/moe_reference.py (fp64, from the same seed).

    torchrun --standalone --nproc-per-node 4 tests/mp/moe_checks.py

For each layout (tp, ep, etp; sequence parallel when tp > 1), dispatcher, routing (top-1 with
pre-softmax, top-2 softmax, top-2 sigmoid) and capacity (none, or a factor that drops tokens),
every rank builds every rank's input and output gradient from one generator, runs its own
block through the layer (train mode, load-balancing loss on), backward with its block of
``sum(out * dout)``, then the gradient reductions: the sequence-parallel sums over tp
(mpu_lab.core.distributed.allreduce_sequence_parallel_grads) and the data-parallel average
(mpu_lab.core.distributed.allreduce_data_parallel_grads: dense parameters over the
data-parallel group, experts over the expert-data-parallel group, both / d). The reference
does the same maths in one process: outputs per rank, and gradients of
``sum_r sum(out_r * dout_r) + aux`` (divided by d for the parameters).

Every rank reports ``{"rank", "world", "groups": {layout: {"dp", "expert-dp"}},
"cases": {name: {"out", "dx", "router", "fc1", "fc2", "kept_equal", "dropped"}}}``: max abs
errors, whether the kept (token, expert) pairs equal the reference's, and how many pairs the
reference dropped. tests/models/moe/test_moe_mp.py asserts.
"""
import torch
import torch.distributed as dist

import moe_reference    # this script's folder is first on sys.path
from mpu_lab.training import initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state as ps
from mpu_lab.core.distributed import (allreduce_data_parallel_grads,
                                      allreduce_sequence_parallel_grads)
from mpu_lab.core.transformer import TransformerConfig
from mpu_lab.core.transformer.moe import MoELayer

SEQ, BATCH, HIDDEN, FFN, EXPERTS = 8, 2, 8, 16, 8
SEED = 1234
LAYOUTS = {4: [(1, 4, 1), (1, 2, 1), (2, 2, 1), (2, 2, 2)], 8: [(2, 4, 2), (2, 2, 2)]}
ROUTINGS = {"top1": dict(moe_router_topk=1, moe_router_pre_softmax=True),
            "top2": dict(moe_router_topk=2),
            "top2-sigmoid": dict(moe_router_topk=2, moe_router_score_function="sigmoid")}
CAPACITIES = {"dropless": None, "capacity1.0": 1.0}


def layout_name(tp, ep, etp):
    return f"tp{tp}-ep{ep}-etp{etp}"


def case_names(world):
    return [f"{layout_name(*layout)}/{dispatcher}/{routing}/{capacity}"
            for layout in LAYOUTS[world] for dispatcher in ("alltoall", "allgather")
            for routing in ROUTINGS for capacity in CAPACITIES]


def make_config(tp, dispatcher, routing, capacity):
    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1,
                             ffn_hidden_size=FFN, init_method_std=0.5, sequence_parallel=tp > 1,
                             num_moe_experts=EXPERTS, moe_token_dispatcher_type=dispatcher,
                             moe_aux_loss_coeff=0.05, moe_expert_capacity_factor=capacity,
                             **ROUTINGS[routing])


def reference(config, world, tp, seed):
    """Inputs and output gradients of every rank ``[world, s/t, b, h]``, and the reference's
    outputs, kept pairs and gradients (fp64). It depends on tp (the sequence split) and on the
    routing and capacity, not on the dispatcher, ep or etp: run_case computes it once per
    (tp, routing, capacity) and reuses it for the cases that differ only in those."""
    gen = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(world, SEQ // tp, BATCH, HIDDEN, generator=gen)
    douts = torch.randn(world, SEQ // tp, BATCH, HIDDEN, generator=gen)
    router, fc1, fc2 = (w for w in moe_reference.master_weights(config, seed))
    leaves = [router.double().requires_grad_(True)] + \
        [w.double().requires_grad_(True) for w in fc1 + fc2]
    inputs = [x.reshape(-1, HIDDEN).double().requires_grad_(True) for x in xs]
    groups = [list(range(start, start + tp)) for start in range(0, world, tp)]
    outs, kept, aux = moe_reference.moe(inputs, leaves[0], leaves[1:1 + EXPERTS],
                                        leaves[1 + EXPERTS:], config, groups)
    loss = sum((o * d.reshape(-1, HIDDEN).double()).sum() for o, d in zip(outs, douts)) + aux
    loss.backward()
    return {"xs": xs, "douts": douts, "outs": [o.detach() for o in outs], "kept": kept,
            "dx": [x.grad for x in inputs], "router": leaves[0].grad,
            "fc1": [w.grad for w in leaves[1:1 + EXPERTS]],
            "fc2": [w.grad for w in leaves[1 + EXPERTS:]]}


def err(got, want):
    return (got.double() - want).abs().max().item() if want.numel() else 0.0


_REFERENCES = {}     # (tp, routing, capacity) -> reference(...), shared by dispatchers, ep, etp


def run_case(config, world, tp, routing, capacity):
    rank = dist.get_rank()
    if (tp, routing, capacity) not in _REFERENCES:
        _REFERENCES[tp, routing, capacity] = reference(config, world, tp, SEED)
    ref = _REFERENCES[tp, routing, capacity]
    torch.manual_seed(SEED)
    layer = MoELayer(config)
    layer.train()
    x = ref["xs"][rank].clone().requires_grad_(True)
    out, bias = layer(x)
    assert bias is None
    (out * ref["douts"][rank]).sum().backward()
    allreduce_sequence_parallel_grads(layer)
    allreduce_data_parallel_grads(list(layer.parameters()))
    d = ps.get_data_parallel_world_size()
    etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    fc1 = fc2 = 0.0
    for i, expert in enumerate(layer.experts.local_experts):
        e = layer.local_expert_indices[i]
        fc1 = max(fc1, err(expert.linear_fc1.weight.grad,
                           torch.chunk(ref["fc1"][e] / d, etp, dim=0)[etp_rank]))
        fc2 = max(fc2, err(expert.linear_fc2.weight.grad,
                           torch.chunk(ref["fc2"][e] / d, etp, dim=1)[etp_rank]))
    with torch.no_grad():
        layer.eval()
        _, routing_map = layer.router(x)
    kept = sorted(map(tuple, routing_map.nonzero().tolist()))
    every = config.moe_router_topk * sum(o.shape[0] for o in ref["outs"])
    return {"out": err(out.reshape(-1, HIDDEN), ref["outs"][rank]),
            "dx": err(x.grad.reshape(-1, HIDDEN), ref["dx"][rank]),
            "router": err(layer.router.weight.grad, ref["router"] / d), "fc1": fc1, "fc2": fc2,
            "kept_equal": kept == [tuple(p) for p in ref["kept"][rank]],
            "dropped": every - sum(len(k) for k in ref["kept"])}


@launcher.entrypoint
def main():
    initialize.init()
    world = dist.get_world_size()
    report = {"rank": dist.get_rank(), "world": world, "groups": {}, "cases": {}}
    for tp, ep, etp in LAYOUTS[world]:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=etp)
        name = layout_name(tp, ep, etp)
        report["groups"][name] = {"dp": ps.get_group_ranks("dp"),
                                  "expert-dp": ps.get_group_ranks("expert-dp")}
        for dispatcher in ("alltoall", "allgather"):
            for routing in ROUTINGS:
                for capacity, factor in CAPACITIES.items():
                    config = make_config(tp, dispatcher, routing, factor)
                    key = f"{name}/{dispatcher}/{routing}/{capacity}"
                    try:
                        report["cases"][key] = run_case(config, world, tp, routing, capacity)
                    except Exception as exc:    # a rank stops at once, naming the case
                        raise RuntimeError(f"case {key} failed on rank {dist.get_rank()}") from exc
    launcher.report(report)
    initialize.shutdown()


if __name__ == "__main__":
    main()
