"""The model's shape and options, :class:`TransformerConfig` (a subset of Megatron-core's
``core/transformer/transformer_config.py``), with its pure checks — ``ValueError`` naming the
numbers when a shape cannot be split ``t`` ways — and Megatron's init methods; and
:data:`ACTIVATIONS`, the MLP's activation functions by name. It imports nothing from
:mod:`mpu_lab.core.transformer`, so the blocks can all import it."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import List, Optional

import torch
import torch.nn.functional as F

from mpu_lab.core.utils import divisors

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}
# What this mirror can recompute selectively (Megatron-core also has "layernorm", "moe_act",
# "mla_up_proj", "moe" and "shared_experts", for layers mpu_lab does not build or with
# output-discarding checkpoints it leaves out).
RECOMPUTE_MODULES = ("core_attn", "mlp")
MEGATRON_RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                              "shared_experts")


@dataclasses.dataclass
class TransformerConfig:
    """The model's shape and options (a subset of Megatron-core's ``TransformerConfig``)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: Optional[int] = None       # default 4 * hidden_size, as in the lecture
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    activation: str = "gelu"                    # "gelu" (GPT) or "relu" (the lecture's table)
    sequence_parallel: bool = False
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    params_dtype: torch.dtype = torch.float32
    attention_impl: str = "sdpa"                # "sdpa" or "explicit" (shows the L x L scores)
    # context parallelism (Megatron-core's ModelParallelConfig.context_parallel_size and
    # TransformerConfig.cp_comm_type): attention over the CP ranks' tokens, mpu_lab.core.context_parallel
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"                   # "p2p" (ring), "a2a" or "allgather"
    # mixture of experts (mpu_lab.core.transformer.moe): None = dense MLPs
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"  # or "sigmoid"
    moe_router_pre_softmax: bool = False        # softmax over all experts, then top-k
    moe_token_dispatcher_type: str = "alltoall"  # or "allgather"
    moe_aux_loss_coeff: float = 0.0
    moe_expert_capacity_factor: Optional[float] = None   # None: no token dropping
    # activation recomputation (Korthikanti et al. 2022, §5; Megatron-core's fields and rules):
    # "selective" recomputes recompute_modules in every layer; "full" recomputes whole layers,
    # "uniform": in groups of recompute_num_layers, "block": only the first
    # recompute_num_layers layers of each pipeline stage
    recompute_granularity: Optional[str] = None         # None, "full" or "selective"
    recompute_method: Optional[str] = None              # None, "uniform" or "block" (full)
    recompute_num_layers: Optional[int] = None
    distribute_saved_activations: bool = False          # full: keep 1/t of each saved input
    recompute_modules: Optional[List[str]] = None       # selective; default ["core_attn"]

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]
        self.check_recompute()

    def check_recompute(self) -> None:
        """Megatron-core's checks of the recomputation fields (``TransformerConfig``'s
        ``__post_init__``), as ``ValueError`` naming the values and the fix."""
        g, method, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if g not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity must be None, 'full' or 'selective', got {g!r}")
        if method not in (None, "uniform", "block"):
            raise ValueError(f"recompute_method must be None, 'uniform' or 'block', got {method!r}")
        if g == "full" and method is None:
            raise ValueError("recompute_granularity 'full' needs recompute_method 'uniform' (layers "
                             "in groups of recompute_num_layers) or 'block' (the first "
                             "recompute_num_layers layers of each pipeline stage)")
        if g == "full" and (n is None or n < 1):
            raise ValueError(f"recompute_granularity 'full' needs recompute_num_layers between 1 "
                             f"and the layers of a pipeline stage, got {n}")
        if g == "selective" and n is not None:
            raise ValueError(f"recompute_granularity 'selective' recomputes every layer: "
                             f"recompute_num_layers must be None, got {n}")
        if g is not None and self.distribute_saved_activations and self.sequence_parallel:
            raise ValueError("distribute_saved_activations must be False with sequence_parallel: "
                             "the saved input is already split over the tensor-parallel ranks")
        unknown = sorted(set(self.recompute_modules) - set(MEGATRON_RECOMPUTE_MODULES))
        if unknown:
            raise ValueError(f"recompute_modules {unknown} are not Megatron's; choices: "
                             f"{list(MEGATRON_RECOMPUTE_MODULES)}")
        unsupported = sorted(set(self.recompute_modules) - set(RECOMPUTE_MODULES))
        if g == "selective" and unsupported:
            raise ValueError(f"recompute_modules {unsupported} are Megatron-core's but not built "
                             f"here; mpu_lab recomputes {list(RECOMPUTE_MODULES)}")

    # ------------------------------------------------------------------ checks (pure)
    def check(self, tensor_model_parallel_size: int = 1, seq_length: Optional[int] = None) -> None:
        """Raise ``ValueError`` naming the numbers when this shape cannot be split ``t`` ways."""
        t = tensor_model_parallel_size
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if t < 1:
            raise ValueError(f"tensor_model_parallel_size must be >= 1, got {t}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads} (D = n_H x H needs a whole head dimension H); "
                f"head counts that divide {self.hidden_size}: "
                f"{[d for d in divisors(self.hidden_size) if d <= 128]}")
        if self.num_attention_heads % t:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by the "
                f"tensor-parallel size {t}: each rank must hold whole heads (the lecture's "
                f"d_tp <= n_H, and n_H % d_tp == 0); valid tensor-parallel sizes: "
                f"{divisors(self.num_attention_heads)}")
        if self.ffn_hidden_size % t:
            raise ValueError(f"ffn_hidden_size {self.ffn_hidden_size} is not divisible by the "
                             f"tensor-parallel size {t}: each rank holds ffn_hidden_size / t "
                             f"columns of fc1; use a multiple of {t} (e.g. "
                             f"{self.ffn_hidden_size + (-self.ffn_hidden_size) % t}) or a "
                             f"tensor-parallel size in {divisors(self.ffn_hidden_size)}")
        if self.sequence_parallel and seq_length is not None and seq_length % t:
            raise ValueError(
                f"sequence parallelism splits the sequence over the tensor-parallel group: "
                f"seq_length {seq_length} is not divisible by the tensor-parallel size {t}; "
                f"use a multiple of {t} (e.g. {seq_length + (-seq_length) % t})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, "
                             f"got {self.activation!r}")
        if self.attention_impl not in ("sdpa", "explicit"):
            raise ValueError(f"attention_impl must be 'sdpa' or 'explicit', "
                             f"got {self.attention_impl!r}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    def check_moe(self, expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int = 1,
                  tensor_model_parallel_size: int = 1) -> None:
        """Raise ``ValueError`` naming the numbers when the MoE options (Megatron-core's names
        and rules) cannot work, or cannot be split ``ep`` x ``etp`` ways."""
        e, k = self.num_moe_experts, self.moe_router_topk
        ep, etp = expert_model_parallel_size, expert_tensor_parallel_size
        t = tensor_model_parallel_size
        if e is None or e < 1:
            raise ValueError(f"num_moe_experts must be >= 1 for an MoE layer, got {e}")
        if not 1 <= k <= e:
            raise ValueError(f"moe_router_topk must be in 1..num_moe_experts = 1..{e}, got {k}")
        if ep < 1 or e % ep:
            raise ValueError(f"num_moe_experts {e} is not divisible by the expert-model-parallel "
                             f"size {ep}: each rank holds E / ep whole experts; valid sizes: "
                             f"{divisors(e)}")
        if etp < 1 or self.ffn_hidden_size % etp:
            raise ValueError(f"ffn_hidden_size {self.ffn_hidden_size} is not divisible by the "
                             f"expert-tensor-parallel size {etp}; valid sizes: "
                             f"{divisors(self.ffn_hidden_size)}")
        if t > 1 and not self.sequence_parallel:
            raise ValueError(f"MoE with tensor parallelism (t = {t}) needs sequence_parallel=True "
                             f"(Megatron-core's MoELayer refuses to train without it)")
        choices = {"moe_router_score_function": ("softmax", "sigmoid"),
                   "moe_token_dispatcher_type": ("alltoall", "allgather")}
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {valid}, got {getattr(self, name)!r}")
        softmax = self.moe_router_score_function == "softmax"
        if k == 1 and softmax and not self.moe_router_pre_softmax:
            raise ValueError("moe_router_topk 1 with the softmax score function needs "
                             "moe_router_pre_softmax=True (a softmax over the one chosen logit "
                             "is 1, and the router would get no gradient)")
        if self.moe_aux_loss_coeff < 0:
            raise ValueError(f"moe_aux_loss_coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        cf = self.moe_expert_capacity_factor
        if cf is not None and not cf > 0:
            raise ValueError(f"moe_expert_capacity_factor must be > 0 or None, got {cf}")

    # ------------------------------------------------------------------ init methods
    def init_method(self):
        """Megatron's ``init_method_normal(std)``: N(0, std^2)."""
        return functools.partial(torch.nn.init.normal_, mean=0.0, std=self.init_method_std)

    def output_layer_init_method(self):
        """Megatron's ``scaled_init_method_normal``: N(0, (std / sqrt(2 L))^2) for the layers
        that write into the residual stream (GPT-2's scaling)."""
        std = self.init_method_std / math.sqrt(2.0 * self.num_layers)
        return functools.partial(torch.nn.init.normal_, mean=0.0, std=std)
