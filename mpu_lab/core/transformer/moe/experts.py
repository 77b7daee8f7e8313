"""The experts of a mixture-of-experts layer, :class:`SequentialMLP` (Megatron-core's
``core/transformer/moe/experts.py``, class ``SequentialMLP``, tag core_v0.19.2): this rank's
local experts, run one after the other on their blocks of the dispatched tokens.

Each expert is the dense MLP of :mod:`mpu_lab.core.transformer.mlp` (``linear_fc1``, activation,
``linear_fc2``; Shazeer et al. 2017 §2: each expert a feed-forward network), split across
the *expert*-tensor-parallel group as any tensor-parallel MLP: ``linear_fc1`` by columns
(``[F/etp, h]``), ``linear_fc2`` by rows (``[h, F/etp]``). Unlike the dense MLP, an expert's
linears communicate nothing (Megatron's ``explicit_expert_comm``): the token dispatcher
gathers the tokens over that group before the experts and reduce-scatters the partial sums
after them. The dense MLP cannot be reused as it is: its layers slice over the dense
tensor-parallel group.

Each token's router probability scales the expert's activation (Megatron's
``per_token_scale``, applied after the activation function, before ``linear_fc2``), so the
combine step only adds. Experts have no biases, as Megatron-core's MoE models are run
(``--disable-bias-linear``; it allows expert biases only at etp = 1).

Master weights: every rank builds the whole ``[F, h]`` and ``[h, F]`` of *every* expert, in
order 0 .. E-1 (fc1 then fc2), from the seed on the CPU, and keeps its own experts' slices. So
a single-process MoE from the same seed has the same weights, and the random stream after the
layer is the same on every rank. Expert parameters are marked ``allreduce = False``, as in
Megatron: their gradients are averaged over the expert-data-parallel group, not the dense one.
"""
from __future__ import annotations

from typing import List

import torch

from mpu_lab.core.utils import get_device
from mpu_lab.core import parallel_state
from mpu_lab.core.transformer.transformer_config import ACTIVATIONS, TransformerConfig
from mpu_lab.core.tensor_parallel import (
    linear_with_grad_accumulation_and_async_allreduce, set_tensor_model_parallel_attributes)


class ExpertLinear(torch.nn.Module):
    """One linear of one expert, ``Y = X W^T``: this expert-tensor-parallel rank's slice of the
    master ``[output_size, input_size]`` along ``partition_dim`` (0: column-parallel, 1: row-
    parallel). Megatron's linear function, with no communication inside."""

    def __init__(self, master: torch.Tensor, partition_dim: int, params_dtype: torch.dtype):
        super().__init__()
        etp = parallel_state.get_expert_tensor_parallel_world_size()
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
        mine = torch.chunk(master, etp, dim=partition_dim)[etp_rank]
        self.weight = torch.nn.Parameter(mine.to(device=get_device(),
                                                 dtype=params_dtype).contiguous())
        set_tensor_model_parallel_attributes(self.weight, True, partition_dim, 1)
        self.weight.allreduce = False     # Megatron: an expert-parallel parameter

    def forward(self, input_: torch.Tensor):
        return linear_with_grad_accumulation_and_async_allreduce(input_, self.weight, None), None


class ExpertMLP(torch.nn.Module):
    """``act(x W1^T) * prob @ W2^T`` for one expert; ``forward`` returns ``(output, None)``."""

    def __init__(self, config: TransformerConfig, fc1_master: torch.Tensor,
                 fc2_master: torch.Tensor):
        super().__init__()
        self.activation = ACTIVATIONS[config.activation]
        self.linear_fc1 = ExpertLinear(fc1_master, 0, config.params_dtype)   # [F/etp, h]
        self.linear_fc2 = ExpertLinear(fc2_master, 1, config.params_dtype)   # [h, F/etp]

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor):
        # hidden_states: [n, h], this expert's tokens; per_token_scale: [n], their probabilities
        intermediate, _ = self.linear_fc1(hidden_states)                   # [n, F/etp]
        intermediate = self.activation(intermediate)
        intermediate = intermediate * per_token_scale.unsqueeze(-1).to(intermediate.dtype)
        output, _ = self.linear_fc2(intermediate)     # [n, h], a partial sum when etp > 1
        return output, None


class SequentialMLP(torch.nn.Module):
    """``local_experts``: this rank's ``E / ep`` experts; local expert ``i`` is global expert
    ``ep_rank * E / ep + i``. ``forward(tokens [n, h], tokens_per_expert, probs [n])`` with the
    tokens grouped by local expert, returns ``(output [n, h], None)``."""

    def __init__(self, num_local_experts: int, config: TransformerConfig):
        super().__init__()
        self.num_local_experts = num_local_experts
        first = parallel_state.get_expert_model_parallel_rank() * num_local_experts
        self.local_experts = torch.nn.ModuleList()
        for expert in range(config.num_moe_experts):
            # every rank draws every expert's master weights, in order
            fc1 = torch.empty(config.ffn_hidden_size, config.hidden_size,
                              device="cpu")   # cpu: the master weight, on purpose
            config.init_method()(fc1)
            fc2 = torch.empty(config.hidden_size, config.ffn_hidden_size,
                              device="cpu")   # cpu: the master weight, on purpose
            config.output_layer_init_method()(fc2)
            if first <= expert < first + num_local_experts:
                self.local_experts.append(ExpertMLP(config, fc1, fc2))

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: List[int],
                permuted_probs: torch.Tensor):
        tokens = torch.split(permuted_local_hidden_states, tokens_per_expert, dim=0)
        probs = torch.split(permuted_probs, tokens_per_expert, dim=0)
        outputs = [expert(x, p)[0] for expert, x, p in zip(self.local_experts, tokens, probs)]
        return torch.cat(outputs, dim=0), None
