"""torchrun worker: mpu_lab.models.moe.MoELayer next to Megatron-core's own MoELayer (TopKRouter,
SequentialMLP with its ColumnParallelLinear / RowParallelLinear experts, both dispatchers) on
4 ranks, gloo, CPU. Megatron-core is optional: without it every rank reports ``skipped``.

    torchrun --standalone --nproc-per-node 4 tests/mp/moe_megatron_checks.py

Megatron-core's layer runs once with its own weights, then loads mpu_lab's state dict (the same
parameter names are the point); both run the same input with the load-balancing loss on, and
the outputs and gradients are compared.
Megatron-core runs on a CPU with these patches, applied here only: ``torch.cuda.current_device``
-> "cpu"; no-op CUDA streams and events for the all-to-all dispatcher's host copies; its split
sizes handed over as numpy arrays (what its device-to-host copy makes on a GPU); 0.16's router
gate reads ``te_general_gemm``, undefined without Transformer Engine: set to None.

Every rank reports ``{"rank", "skipped"}`` or ``{"rank", "cases": {name: {"missing",
"unexpected", "out", "dx", "router", "experts", "own_init_out"}}}``: max abs differences
(``own_init_out``: against Megatron-core's layer before it loaded mpu_lab's weights).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpu_lab import distributed, launcher
from mpu_lab import parallel_state as ps
from mpu_lab.labkit import megatron_core
from mpu_lab.models import TransformerConfig, finalize_model_grads
from mpu_lab.models.moe import MoELayer

LAYOUTS = [(1, 2, 1), (1, 4, 1), (2, 2, 2)]      # (tp, ep, etp); sequence parallel when tp > 1
SEQ, BATCH, HIDDEN, FFN, EXPERTS, SEED = 8, 2, 8, 16, 8, 99


class _NoStream:
    """Stands in for torch.cuda.Stream / Event on a CPU rank: everything is already done."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def record_event(self, *args):
        return self

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def patch_megatron_for_cpu():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher   # optional dependency
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.Stream = torch.cuda.Event = _NoStream
    torch.cuda.current_stream = lambda *a: None
    torch.cuda.stream = lambda *a: _NoStream()

    def to_host(tensor, as_numpy=False, record_stream=False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor
    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    if not hasattr(moe_utils, "te_general_gemm"):   # 0.16 reads it without Transformer Engine
        moe_utils.te_general_gemm = None


def megatron_layer(tp, ep, etp, dispatcher, topk):
    from megatron.core import parallel_state as mps              # optional dependency
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig as MegatronConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer as MegatronMoELayer
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.spec_utils import ModuleSpec
    if mps.model_parallel_is_initialized():
        mps.destroy_model_parallel()
    mps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                  expert_tensor_parallel_size=etp,
                                  create_gloo_process_groups=False)
    config = MegatronConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN,
        num_moe_experts=EXPERTS, moe_router_topk=topk, moe_router_pre_softmax=topk == 1,
        moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=0.05,
        moe_router_load_balancing_type="aux_loss", add_bias_linear=False,
        activation_func=F.gelu, bias_activation_fusion=False, gated_linear_unit=False,
        use_cpu_initialization=True, tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1, moe_permute_fusion=False)
    experts = ModuleSpec(module=SequentialMLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    return MegatronMoELayer(config, MoESubmodules(experts=experts),
                            pg_collection=get_default_pg_collection())


def mpu_lab_layer(tp, dispatcher, topk):
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2,
                               ffn_hidden_size=FFN, init_method_std=0.5, sequence_parallel=tp > 1,
                               num_moe_experts=EXPERTS, moe_router_topk=topk,
                               moe_router_pre_softmax=topk == 1, moe_aux_loss_coeff=0.05,
                               moe_token_dispatcher_type=dispatcher)
    torch.manual_seed(SEED)
    return MoELayer(config)


def run(layer, x, dout):
    layer.train()
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * dout).sum().backward()
    finalize_model_grads(layer)       # the router's sequence-parallel sum, in both
    return out.detach(), x.grad


def compare(tp, ep, etp, dispatcher, topk):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    mine = mpu_lab_layer(tp, dispatcher, topk)
    theirs = megatron_layer(tp, ep, etp, dispatcher, topk)
    gen = torch.Generator().manual_seed(SEED + dist.get_rank())
    x = torch.randn(SEQ // tp, BATCH, HIDDEN, generator=gen)
    dout = torch.randn(SEQ // tp, BATCH, HIDDEN, generator=gen)
    out_own_init, _ = run(theirs, x, dout)      # with its own weights: must differ
    theirs.zero_grad(set_to_none=True)
    loaded = theirs.load_state_dict(mine.state_dict(), strict=False)
    (out_a, dx_a), (out_b, dx_b) = run(mine, x, dout), run(theirs, x, dout)
    grads_b = dict(theirs.named_parameters())

    def diff(a, b):
        return (a - b).abs().max().item() if a.numel() else 0.0
    experts = max(diff(p.grad, grads_b[name].grad) for name, p in mine.named_parameters()
                  if name.startswith("experts."))
    return {"missing": [k for k in loaded.missing_keys if not k.endswith("_extra_state")],
            "unexpected": list(loaded.unexpected_keys), "out": diff(out_a, out_b),
            "dx": diff(dx_a, dx_b), "own_init_out": diff(out_a, out_own_init),
            "router": diff(mine.router.weight.grad, grads_b["router.weight"].grad),
            "experts": experts}


def dispatchers(etp):
    """At etp > 1 Megatron-core's all-to-all dispatcher gathers a different number of tokens
    from each expert-tensor-parallel rank with a list ``all_gather``, which gloo refuses
    ("invalid tensor size"; NCCL takes it): there only its all-gather dispatcher runs on a CPU.
    (mpu_lab pads the tokens to the longest before gathering.)"""
    return ("alltoall", "allgather") if etp == 1 else ("allgather",)


@launcher.entrypoint
def main():
    distributed.init()
    report = {"rank": dist.get_rank()}
    if not megatron_core.available():
        report["skipped"] = megatron_core.missing() or "megatron-core is not available"
    else:
        patch_megatron_for_cpu()
        report["cases"] = {}
        for tp, ep, etp in LAYOUTS:
            for dispatcher in dispatchers(etp):
                for topk in (1, 2):
                    name = f"tp{tp}-ep{ep}-etp{etp}/{dispatcher}/top{topk}"
                    report["cases"][name] = compare(tp, ep, etp, dispatcher, topk)
    launcher.report(report)
    distributed.shutdown()


if __name__ == "__main__":
    main()
