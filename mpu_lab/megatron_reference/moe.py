"""Megatron-core's ``MoELayer`` side by side with mpu_lab's, on the same weights and input: the
rank side of ``launch/megatron_core_moe.py`` (lab 13 starts it and prints the report with
:mod:`mpu_lab.labkit.mixture_of_experts.megatron_core`).

Each case (``[tpT-]epE[-etpX]/DISPATCHER/topK``, :func:`parse_case`) builds mpu_lab's
:class:`~mpu_lab.core.transformer.moe.MoELayer` on every rank, then Megatron-core's
(``megatron.core.transformer.moe.moe_layer.MoELayer`` with its ``TopKRouter`` and a
``SequentialMLP`` of ``ColumnParallelLinear`` / ``RowParallelLinear`` experts), which loads
mpu_lab's state dict: the parameter names are the same (``router.weight``,
``experts.local_experts.{i}.linear_fc1.weight`` ...), which is the point. Both run the same
input forward and backward with the load-balancing loss on; each rank reports the largest
differences of the output, the input gradient, the router's gradient and its experts'
gradients, and how far Megatron-core's output was with its *own* weights (it must differ: the
comparison is not vacuous).

Megatron-core runs in the job's ranks only, with :mod:`mpu_lab.megatron_reference.cpu`'s
patches, never in the notebook's kernel; on the CPU under gloo. Where it cannot be imported
every rank reports ``{"skipped": <how to install it>}``.
Checked with megatron-core 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12).

At etp > 1 only the all-gather dispatcher runs: Megatron-core's all-to-all dispatcher then
all-gathers a different number of tokens from each expert-tensor-parallel rank with a list
``all_gather``, which gloo refuses (NCCL takes it).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state as ps
from mpu_lab.megatron_reference import runtime as mc
from mpu_lab.megatron_reference import cpu as megatron_core_cpu
from mpu_lab.core.distributed import allreduce_sequence_parallel_grads
from mpu_lab.core.transformer import TransformerConfig
from mpu_lab.core.transformer.moe import MoELayer

SEQ, BATCH, HIDDEN, FFN, EXPERTS_PER_RANK, AUX_LOSS, SEED = 8, 2, 8, 16, 2, 0.05, 99
TOL = 1e-5      # fp32; the two layers add the same products in different orders
_CASE = re.compile(r"^(?:tp(?P<tp>\d+)-)?ep(?P<ep>\d+)(?:-etp(?P<etp>\d+))?"
                   r"/(?P<dispatcher>alltoall|allgather)/top(?P<topk>\d+)$")


@dataclasses.dataclass(frozen=True)
class Case:
    """One layout: tensor-parallel ``tp`` (sequence parallel when > 1), expert-parallel ``ep``,
    expert-tensor-parallel ``etp``, the dispatcher and the router's ``topk``."""

    tp: int
    ep: int
    etp: int
    dispatcher: str
    topk: int

    @property
    def name(self) -> str:
        parts = ([f"tp{self.tp}"] if self.tp > 1 else []) + [f"ep{self.ep}"] + \
            ([f"etp{self.etp}"] if self.etp > 1 else [])
        return f"{'-'.join(parts)}/{self.dispatcher}/top{self.topk}"


def parse_case(name: str, world_size: Optional[int] = None) -> Case:
    """``"ep2/alltoall/top2"``, ``"tp2-ep2-etp2/allgather/top1"`` -> :class:`Case`, checked
    (against ``world_size`` when given)."""
    m = _CASE.match(name)
    if m is None:
        raise ValueError(f"case {name!r} is not [tpT-]epE[-etpX]/alltoall|allgather/topK, "
                         f"e.g. 'ep2/alltoall/top2'")
    case = Case(int(m["tp"] or 1), int(m["ep"]), int(m["etp"] or m["tp"] or 1), m["dispatcher"],
                int(m["topk"]))
    if case.etp > 1 and case.dispatcher == "alltoall":
        raise ValueError(f"case {name!r}: Megatron-core's all-to-all dispatcher at etp > 1 does "
                         f"not run on gloo; use allgather there")
    if not 1 <= case.topk <= EXPERTS_PER_RANK * case.ep:
        raise ValueError(f"case {name!r}: top{case.topk} needs 1..{EXPERTS_PER_RANK * case.ep} "
                         f"(the layer has {EXPERTS_PER_RANK} experts per ep rank)")
    if world_size is not None:
        for what, size in (("tp", case.tp), ("etp x ep", case.etp * case.ep)):
            if world_size % size:
                raise ValueError(f"case {name!r}: {what} = {size} does not divide the "
                                 f"{world_size} ranks")
    return case


# --------------------------------------------------------------------------- rank side
def _megatron_layer(case: Case, num_experts: int):
    with mc.without_cuda_runtime_notice():
        # megatron-core is optional (and slow to import): imported only where it is used.
        from megatron.core import parallel_state as mps
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer import TransformerConfig as MegatronConfig
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import SequentialMLP
        from megatron.core.transformer.moe.moe_layer import MoELayer as MegatronMoELayer
        from megatron.core.transformer.moe.moe_layer import MoESubmodules
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
        from megatron.core.transformer.spec_utils import ModuleSpec
    if mps.model_parallel_is_initialized():
        mc.destroy(mpu_lab_too=False)
    mps.initialize_model_parallel(tensor_model_parallel_size=case.tp,
                                  expert_model_parallel_size=case.ep,
                                  expert_tensor_parallel_size=case.etp,
                                  create_gloo_process_groups=False)
    config = MegatronConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN,
        num_moe_experts=num_experts, moe_router_topk=case.topk,
        moe_router_pre_softmax=case.topk == 1, moe_token_dispatcher_type=case.dispatcher,
        moe_aux_loss_coeff=AUX_LOSS, moe_router_load_balancing_type="aux_loss",
        add_bias_linear=False, activation_func=F.gelu, bias_activation_fusion=False,
        gated_linear_unit=False, use_cpu_initialization=True,
        tensor_model_parallel_size=case.tp, expert_model_parallel_size=case.ep,
        expert_tensor_parallel_size=case.etp, sequence_parallel=case.tp > 1,
        moe_permute_fusion=False)
    experts = ModuleSpec(module=SequentialMLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    return MegatronMoELayer(config, MoESubmodules(experts=experts),
                            pg_collection=get_default_pg_collection())


def _mpu_lab_layer(case: Case, num_experts: int) -> MoELayer:
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2,
                               ffn_hidden_size=FFN, init_method_std=0.5,
                               sequence_parallel=case.tp > 1, num_moe_experts=num_experts,
                               moe_router_topk=case.topk, moe_router_pre_softmax=case.topk == 1,
                               moe_aux_loss_coeff=AUX_LOSS,
                               moe_token_dispatcher_type=case.dispatcher)
    torch.manual_seed(SEED)
    return MoELayer(config)


def _run(layer, x: torch.Tensor, dout: torch.Tensor):
    layer.train()
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * dout).sum().backward()
    allreduce_sequence_parallel_grads(layer)  # the router's sequence-parallel sum, in both
    return out.detach(), x.grad


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def compare_case(case: Case) -> Dict[str, object]:
    """Runs inside every rank (the default group made by ``initialize.init``): mpu_lab's
    layer and Megatron-core's on this rank's ``[s/tp, b, h]`` input. Returns ``{case,
    ep_rank, missing, unexpected, out, dx, router, experts, own_init_out}``."""
    num_experts = EXPERTS_PER_RANK * case.ep
    ps.initialize_model_parallel(tensor_model_parallel_size=case.tp,
                                 expert_model_parallel_size=case.ep,
                                 expert_tensor_parallel_size=case.etp)
    on_cpu = initialize.get_device().type == "cpu"
    try:
        mine = _mpu_lab_layer(case, num_experts)
        with megatron_core_cpu.cpu_patches(on_cpu), megatron_core_cpu.moe_patches(on_cpu):
            theirs = _megatron_layer(case, num_experts)
            gen = torch.Generator().manual_seed(SEED + dist.get_rank())
            x = torch.randn(SEQ // case.tp, BATCH, HIDDEN, generator=gen)  # cpu: the job runs on CPUs
            dout = torch.randn(SEQ // case.tp, BATCH, HIDDEN, generator=gen)  # cpu: the job runs on CPUs
            out_own_init, _ = _run(theirs, x, dout)    # its own weights: must differ
            theirs.zero_grad(set_to_none=True)
            loaded = theirs.load_state_dict(mine.state_dict(), strict=False)
            out_b, dx_b = _run(theirs, x, dout)
        out_a, dx_a = _run(mine, x, dout)
        grads_b = dict(theirs.named_parameters())
        experts = max(_diff(p.grad, grads_b[name].grad) for name, p in mine.named_parameters()
                      if name.startswith("experts."))
        return {"case": case.name, "ep_rank": ps.get_expert_model_parallel_rank(),
                "missing": [k for k in loaded.missing_keys if not k.endswith("_extra_state")],
                "unexpected": list(loaded.unexpected_keys), "out": _diff(out_a, out_b),
                "dx": _diff(dx_a, dx_b), "own_init_out": _diff(out_a, out_own_init),
                "router": _diff(mine.router.weight.grad, grads_b["router.weight"].grad),
                "experts": experts}
    finally:
        mc.destroy()


# --------------------------------------------------------------------------- driver side
DEFAULT_CASES = ("ep2/alltoall/top2", "ep2/allgather/top2", "ep4/alltoall/top1")
