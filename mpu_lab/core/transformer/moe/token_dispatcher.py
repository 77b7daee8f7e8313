"""Token dispatchers: how tokens reach the rank that holds their expert and come back
(Megatron-core's ``core/transformer/moe/token_dispatcher.py``, tag core_v0.19.2; without its
drop-and-pad, shared-expert overlap, CUDA-stream and fused paths).

Expert parallelism (GShard, Lepikhin et al. 2020, shards the experts across devices and sends
each token to its experts' device): the ``ep`` ranks of the expert-model-parallel group hold
``E / ep`` experts each.
Both dispatchers run the same six steps, with Megatron's names, around the experts:

    dispatch_preprocess -> token_dispatch -> dispatch_postprocess -> experts
    -> combine_preprocess -> token_combine -> combine_postprocess

* :class:`MoEAlltoAllTokenDispatcher`: each rank sends each peer only the tokens routed to
  the peer's experts: an all-to-all of the token counts, then an all-to-all of the tokens (and
  of their probabilities, which the experts apply) with those counts as split sizes.
* :class:`MoEAllGatherTokenDispatcher`: every rank gathers every token of the group, keeps
  those of its experts, and a reduce-scatter brings each rank the sum for its own tokens.
  Simple, but each rank receives ``ep x`` its tokens: it wins when ``k`` is close to ``E``
  or ``ep`` is small.

With expert tensor parallelism (``etp`` ranks split each expert), the tokens are gathered
over the expert-tensor-parallel group before the experts and the partial sums reduce-scattered
after them.
"""
from __future__ import annotations

from typing import List

import torch

from mpu_lab.core import comm, parallel_state
from mpu_lab.core.comm import exchange
from mpu_lab.core.transformer.moe.moe_utils import permute, sort_chunks_by_idxs, unpermute
from mpu_lab.core.tensor_parallel import (
    gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region)


# --------------------------------------------------------------------------- collectives (autograd)
class _AllToAll(torch.autograd.Function):
    """All-to-all with split sizes; backward: the reverse all-to-all (splits swapped)."""

    @staticmethod
    def forward(ctx, input_, group, output_split_sizes, input_split_sizes):
        ctx.group, ctx.splits = group, (output_split_sizes, input_split_sizes)
        if comm.group_size(group) == 1:
            return input_
        return exchange.all_to_all_with_splits(input_, output_split_sizes, input_split_sizes, group)

    @staticmethod
    def backward(ctx, grad_output):
        output_split_sizes, input_split_sizes = ctx.splits
        return (_AllToAll.apply(grad_output, ctx.group, input_split_sizes, output_split_sizes),
                None, None, None)


def all_to_all(group, input_, output_split_sizes: List[int], input_split_sizes: List[int]):
    """Megatron-core's ``tensor_parallel.mappings.all_to_all``: differentiable, uneven splits."""
    return _AllToAll.apply(input_, group, output_split_sizes, input_split_sizes)


def _padded(rows: torch.Tensor, length: int) -> torch.Tensor:
    return torch.cat([rows, rows.new_zeros((length - rows.size(0),) + tuple(rows.shape[1:]))])


def _gather_uneven(input_, group, sizes):
    """Every rank's rows (``sizes[j]`` from group rank ``j``) concatenated: an all-gather of
    copies zero-padded to the longest, then unpadded (an all-gather needs equal sizes)."""
    longest = max(max(sizes), 1)
    gathered = comm.all_gather(_padded(input_, longest), group=group, dim=0)
    return torch.cat([chunk[:n] for chunk, n in zip(gathered.split(longest), sizes)])


def _reduce_scatter_uneven(input_, group, sizes, rank):
    """The sum over the group of ``input_``, of which this rank keeps its ``sizes[rank]`` rows."""
    longest = max(max(sizes), 1)
    padded = torch.cat([_padded(chunk, longest) for chunk in input_.split(sizes)])
    return comm.reduce_scatter(padded, group=group, dim=0)[:sizes[rank]]


class _GatherFromExpertTensorParallel(torch.autograd.Function):
    """Gather rows over the expert-tensor-parallel group (uneven sizes); backward: the gradients
    are partial sums (each rank holds a slice of the experts), so reduce-scatter them."""

    @staticmethod
    def forward(ctx, input_, group, sizes, rank):
        ctx.group, ctx.sizes, ctx.rank = group, sizes, rank
        return _gather_uneven(input_, group, sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce_scatter_uneven(grad_output, ctx.group, ctx.sizes, ctx.rank), None, None, None


class _ReduceScatterToExpertTensorParallel(torch.autograd.Function):
    """Sum the experts' partial outputs over the expert-tensor-parallel group and keep this
    rank's rows; backward: gather the gradients."""

    @staticmethod
    def forward(ctx, input_, group, sizes, rank):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter_uneven(input_, group, sizes, rank)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_uneven(grad_output, ctx.group, ctx.sizes), None, None, None


class MoETokenDispatcher:
    """What both dispatchers share: the expert groups and this rank's experts."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config):
        self.config = config
        self.num_experts = config.num_moe_experts
        self.num_local_experts, self.local_expert_indices = num_local_experts, local_expert_indices
        self.ep_group = parallel_state.get_expert_model_parallel_group()
        self.ep_size = parallel_state.get_expert_model_parallel_world_size()
        self.tp_group = parallel_state.get_expert_tensor_parallel_group()
        self.tp_size = parallel_state.get_expert_tensor_parallel_world_size()
        self.tp_rank = parallel_state.get_expert_tensor_parallel_rank()
        self.tp_ep_group = parallel_state.get_expert_tensor_and_model_parallel_group()
        self.tp_ep_size = parallel_state.get_expert_tensor_and_model_parallel_world_size()


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    """All-gather over the expert tensor x model parallel group, local experts, reduce-scatter."""

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        return hidden_states.reshape(-1, self.hidden_shape[-1]), probs       # [T, h], [T, E]

    def token_dispatch(self, hidden_states, probs):
        if self.tp_ep_size > 1:      # [T, .] -> [T * tp_ep, .]: every token of the group
            with torch.no_grad():
                gathered = comm.all_gather(self.routing_map.to(torch.int32), group=self.tp_ep_group)
                self.routing_map = gathered.bool()
            probs = gather_from_sequence_parallel_region(probs, group=self.tp_ep_group)
            hidden_states = gather_from_sequence_parallel_region(hidden_states,
                                                                 group=self.tp_ep_group)
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, first:last].contiguous()        # [T*tp_ep, E/ep]
        local_probs = probs[:, first:last].contiguous()
        tokens_per_expert = self.local_map.sum(dim=0).tolist()
        permuted, permuted_probs, self.reversed_local_input_permutation_mapping = permute(
            hidden_states, self.local_map, local_probs)
        return permuted, tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states):
        return unpermute(hidden_states, self.reversed_local_input_permutation_mapping,
                         self.hidden_shape_before_permute)

    def token_combine(self, hidden_states):
        if self.tp_ep_size > 1:      # sum the partial outputs, keep this rank's tokens
            hidden_states = reduce_scatter_to_sequence_parallel_region(hidden_states,
                                                                       group=self.tp_ep_group)
        return hidden_states

    def combine_postprocess(self, hidden_states):
        return hidden_states.view(self.hidden_shape)


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    """Permute, all-to-all (counts, then tokens) over ep, gather over etp, sort by local
    expert; after the experts the reverse. Split sizes are plain lists of ints on the host."""

    def preprocess(self, routing_map: torch.Tensor) -> List[int]:
        """The count exchange. Returns the tokens each local expert will get; keeps the split
        sizes of both all-to-alls and of the etp gather."""
        # [E] tokens this rank sends to each expert, grouped by the ep rank that holds it
        counts = routing_map.sum(dim=0).long().reshape(self.ep_size, self.num_local_experts)
        self.input_splits = counts.sum(dim=1).tolist()                       # [ep]
        # all-to-all of the counts: row j = what ep rank j sends to each of my experts
        received = (exchange.all_to_all(counts, group=self.ep_group) if self.ep_size > 1
                    else counts)                                             # [ep, E/ep]
        # ... and what the other etp ranks of my experts receive: [etp, ep, E/ep]
        per_source = (comm.all_gather(received.unsqueeze(0), group=self.tp_group)
                      if self.tp_size > 1 else received.unsqueeze(0))
        self.output_splits = received.sum(dim=1).tolist()                    # [ep]
        self.output_splits_tp = per_source.sum(dim=(1, 2)).tolist()          # [etp]
        # chunks arrive as [etp][ep][local expert]; the experts want [local expert][etp][ep]
        self.num_global_tokens_per_local_expert = per_source.reshape(-1, self.num_local_experts)
        sources, experts = self.tp_size * self.ep_size, self.num_local_experts
        self.sort_input_by_local_experts = [source * experts + e for e in range(experts)
                                            for source in range(sources)]
        self.restore_output_by_local_experts = [e * sources + source for source in range(sources)
                                                for e in range(experts)]
        return self.num_global_tokens_per_local_expert.sum(dim=0).tolist()   # [E/ep]

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, self.hidden_shape[-1])     # [T, h]
        self.tokens_per_expert = self.preprocess(routing_map)
        self.hidden_shape_before_permute = hidden_states.shape
        # Permutation 1: one row per (token, chosen expert), grouped by expert, so by ep rank
        permuted, permuted_probs, self.reversed_local_input_permutation_mapping = permute(
            hidden_states, routing_map, probs)
        return permuted, permuted_probs

    def token_dispatch(self, permuted_tokens, permuted_probs):
        tokens = all_to_all(self.ep_group, permuted_tokens, self.output_splits, self.input_splits)
        probs = all_to_all(self.ep_group, permuted_probs, self.output_splits, self.input_splits)
        return tokens, probs

    def dispatch_postprocess(self, tokens, probs):
        if self.tp_size > 1:      # both etp ranks of my experts need all their tokens
            sizes, rank = self.output_splits_tp, self.tp_rank
            tokens = _GatherFromExpertTensorParallel.apply(tokens, self.tp_group, sizes, rank)
            probs = _GatherFromExpertTensorParallel.apply(probs, self.tp_group, sizes, rank)
        if self.num_local_experts > 1:   # Permutation 2: sort the chunks by local expert
            sizes = self.num_global_tokens_per_local_expert.reshape(-1).tolist()
            tokens = sort_chunks_by_idxs(tokens, sizes, self.sort_input_by_local_experts)
            probs = sort_chunks_by_idxs(probs, sizes, self.sort_input_by_local_experts)
        return tokens, self.tokens_per_expert, probs

    def combine_preprocess(self, hidden_states):
        if self.num_local_experts > 1:   # Unpermutation 2: back to [etp][ep][local expert]
            sizes = self.num_global_tokens_per_local_expert.t().reshape(-1).tolist()
            hidden_states = sort_chunks_by_idxs(hidden_states, sizes,
                                                self.restore_output_by_local_experts)
        if self.tp_size > 1:      # sum the etp partial outputs, keep the rows of my ep peers
            hidden_states = _ReduceScatterToExpertTensorParallel.apply(
                hidden_states, self.tp_group, self.output_splits_tp, self.tp_rank)
        return hidden_states

    def token_combine(self, hidden_states):
        return all_to_all(self.ep_group, hidden_states, self.input_splits, self.output_splits)

    def combine_postprocess(self, permuted_tokens):
        # Unpermutation 1: each token gets the sum of its experts' (weighted) outputs
        output = unpermute(permuted_tokens, self.reversed_local_input_permutation_mapping,
                           self.hidden_shape_before_permute)
        return output.view(self.hidden_shape)
