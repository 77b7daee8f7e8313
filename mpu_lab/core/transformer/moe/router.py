"""The router of a mixture-of-experts layer, :class:`TopKRouter` (Megatron-core's
``core/transformer/moe/router.py``, tag core_v0.19.2; simplified: no z-loss, input jitter,
sinkhorn, group-limited or aux-loss-free routing, sequence-level or global aux loss).

The sparsely-gated mixture of experts (Shazeer et al. 2017, §2.1): a linear gate scores
every expert for every token, each token goes to its ``k`` best experts, and its output is the
probability-weighted sum of theirs. GShard (Lepikhin et al. 2020) and Switch Transformers
(Fedus et al. 2021, §2.2) add an expert *capacity*, beyond which tokens are dropped, and an
auxiliary loss that pushes the router towards a uniform load.

Steps, as Megatron names them: :meth:`TopKRouter.gating` (logits), then
:meth:`TopKRouter.routing`: top-k with the score function, token dropping, the
load-balancing loss attached to the probabilities (:class:`MoEAuxLossAutoScaler`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mpu_lab.core.utils import get_device
from mpu_lab.core import parallel_state
from mpu_lab.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler, apply_router_token_dropping, switch_load_balancing_loss_func,
    topk_routing_with_score_function)
from mpu_lab.core.transformer.transformer_config import TransformerConfig
from mpu_lab.core.tensor_parallel import reduce_from_tensor_model_parallel_region


class TopKRouter(torch.nn.Module):
    """``weight`` ``[E, h]`` (no bias); ``forward([s, b, h]) -> (probs, routing_map)``, both
    ``[s*b, E]`` over this rank's tokens (``[s/t, b, h]`` with sequence parallelism).

    The weight is the same on every rank (built from the seed on the CPU, like every master
    weight of the mirror). With sequence parallelism each tensor-parallel rank routes its own
    block of the sequence, so the weight is marked ``sequence_parallel``: its gradient is
    summed over the tensor-parallel group after backward, like a LayerNorm's.
    ``load_balancing_loss`` keeps the last aux loss (divided by its coefficient), for logging.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.num_experts, self.topk = config.num_moe_experts, config.moe_router_topk
        self.score_function = config.moe_router_score_function
        master = torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32,
                             device="cpu")   # cpu: the master weight, on purpose
        config.init_method()(master)
        self.weight = torch.nn.Parameter(master.to(device=get_device(),
                                                   dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel
        self.load_balancing_loss = None

    def gating(self, input_: torch.Tensor) -> torch.Tensor:
        """Router logits ``[s, b, E]`` (Shazeer et al.'s ``x W_g``), in fp32."""
        return F.linear(input_.float(), self.weight.float())

    def routing(self, logits: torch.Tensor):
        """``(probs, routing_map)`` ``[tokens, E]`` from the logits ``[s, b, E]``."""
        logits = logits.reshape(-1, self.num_experts)                       # [T, E]
        probs, routing_map = topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=self.config.moe_router_pre_softmax,
            score_function=self.score_function)
        if self.config.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, self.topk, self.config.moe_expert_capacity_factor)
        if self.training and torch.is_grad_enabled() and self.config.moe_aux_loss_coeff > 0:
            probs = self._apply_aux_loss(logits, probs)
        return probs, routing_map

    def _apply_aux_loss(self, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Switch's load-balancing loss over the tokens of the whole sequence, attached to
        ``probs`` so that backward adds its gradient.

        Megatron counts the load *before* dropping, from the scores over all experts: a
        softmax, or for sigmoid routing the sigmoids normalised per token. The counts are summed
        over the tensor-parallel group, whose ranks route the blocks of one sequence under
        sequence parallelism (Megatron: the tp x cp group; no context parallelism here).
        """
        coeff = self.config.moe_aux_loss_coeff
        if self.score_function == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = torch.sigmoid(logits)
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        _, top = torch.topk(scores, k=self.topk, dim=1)
        chosen = torch.zeros_like(scores).scatter(1, top, 1.0)             # [T, E]
        group = parallel_state.get_tensor_model_parallel_group()
        group_size = parallel_state.get_tensor_model_parallel_world_size()
        if not self.config.sequence_parallel:   # every tensor-parallel rank has the same tokens
            group, group_size = None, 1
        tokens_per_expert = chosen.sum(dim=0)
        if group is not None and group_size > 1:
            tokens_per_expert = reduce_from_tensor_model_parallel_region(tokens_per_expert,
                                                                         group=group)
        total_tokens = logits.size(0) * group_size
        aux_loss = switch_load_balancing_loss_func(scores, tokens_per_expert, total_tokens,
                                                   self.topk, self.num_experts, coeff)
        self.load_balancing_loss = (aux_loss / coeff).detach()
        return MoEAuxLossAutoScaler.apply(probs, aux_loss)

    def forward(self, input_: torch.Tensor):
        return self.routing(self.gating(input_))
