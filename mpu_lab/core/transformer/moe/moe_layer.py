"""The mixture-of-experts layer, :class:`MoELayer` (Megatron-core's
``core/transformer/moe/moe_layer.py``, tag core_v0.19.2; no shared experts, latent projection,
recomputation or CUDA graphs), which takes the place of a transformer layer's MLP.

    y = sum over the k experts i a token is routed to of  p_i(x) * E_i(x)

(Shazeer et al. 2017, eq. 1, with top-k gating; GShard and Switch Transformers for the
capacity and the load-balancing loss). A rank holds ``E / ep`` experts; tokens travel to
them and back through a token dispatcher. The forward reads as Megatron's:
route -> dispatch -> experts -> combine.

Parameter names are Megatron-core's: ``router.weight`` ``[E, h]``,
``experts.local_experts.{i}.linear_fc1.weight`` (``[F/etp, h]``) and ``...linear_fc2.weight``
(``[h, F/etp]``), local expert ``i`` being global expert ``ep_rank * E / ep + i``.

:func:`is_expert_parameter` is Megatron's mark of an expert parameter (``allreduce = False``):
its gradient is averaged over the *expert*-data-parallel group, not the data-parallel one
(:func:`mpu_lab.core.distributed.allreduce_data_parallel_grads`, or the expert buffer of
:class:`~mpu_lab.core.distributed.DistributedDataParallel`).
"""
from __future__ import annotations

import torch

from mpu_lab.core import parallel_state
from mpu_lab.core.transformer.moe.experts import SequentialMLP
from mpu_lab.core.transformer.moe.router import TopKRouter
from mpu_lab.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher)
from mpu_lab.core.transformer.transformer_config import TransformerConfig

TOKEN_DISPATCHERS = {"alltoall": MoEAlltoAllTokenDispatcher,
                     "allgather": MoEAllGatherTokenDispatcher}


class MoELayer(torch.nn.Module):
    """``forward(hidden_states [s, b, h]) -> (output [s, b, h], None)`` (``[s/t, b, h]`` with
    sequence parallelism), in place of :class:`mpu_lab.core.transformer.mlp.MLP`. Needs the expert groups
    of :func:`mpu_lab.core.parallel_state.initialize_model_parallel`; ``config.check_moe`` runs first
    with their sizes."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        ep = parallel_state.get_expert_model_parallel_world_size()
        config.check_moe(ep, parallel_state.get_expert_tensor_parallel_world_size(),
                         parallel_state.get_tensor_model_parallel_world_size())
        self.config = config
        self.num_local_experts = config.num_moe_experts // ep
        first = parallel_state.get_expert_model_parallel_rank() * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        self.router = TopKRouter(config)       # built first: its master weight comes first
        self.experts = SequentialMLP(self.num_local_experts, config)
        self.token_dispatcher = TOKEN_DISPATCHERS[config.moe_token_dispatcher_type](
            self.num_local_experts, self.local_expert_indices, config)

    def forward(self, hidden_states: torch.Tensor):
        dispatcher = self.token_dispatcher
        # 1. route: which experts, with which probabilities ([tokens, E] each)
        probs, routing_map = self.router(hidden_states)
        # 2. dispatch: the tokens (and their probabilities) to the ranks of their experts
        tokens, probs = dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)
        tokens, probs = dispatcher.token_dispatch(tokens, probs)
        tokens, tokens_per_expert, probs = dispatcher.dispatch_postprocess(tokens, probs)
        # 3. the local experts, each on its block of tokens
        output, mlp_bias = self.experts(tokens, tokens_per_expert, probs)
        # 4. combine: the outputs back to the tokens' ranks, summed per token
        output = dispatcher.combine_preprocess(output)
        output = dispatcher.token_combine(output)
        output = dispatcher.combine_postprocess(output)
        return output, mlp_bias


# --------------------------------------------------------------------------- gradients
def is_expert_parameter(param: torch.nn.Parameter) -> bool:
    """Megatron's test: an expert-parallel parameter carries ``allreduce = False``."""
    return not getattr(param, "allreduce", True)
