"""Context parallelism (CP): the sequence split across ranks, attention computed across them.

Activation memory grows with the sequence length s, and sequence parallelism splits the
activations only outside attention. CP splits the whole sequence, attention included: each of
the cp ranks of a CP group holds s/cp tokens of every layer, and attention, the one place where
tokens meet, exchanges keys and values between the ranks. The weights stay whole on every CP
rank, so CP only changes the data and attention.

What it mirrors:

* :func:`get_batch_on_this_cp_rank` (:mod:`.layout`): Megatron's ``get_batch_on_this_cp_rank``
  (megatron/training/utils.py, and megatron/core/utils.py in Megatron-core), the
  load-balanced "zig-zag" layout: rank r keeps chunks r and 2cp-1-r of 2cp.
* :func:`attention` (:mod:`.attention_with_cp`): TransformerEngine's ``attn_forward_func_with_cp``
  (transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py), which
  Megatron-core's ``TEDotProductAttention`` calls with ``--cp-comm-type``:

  - ``"p2p"``: ``AttnFuncWithCPAndKVP2P``, ring attention (:mod:`.ring_attention`, with the
    log-sum-exp merge of :mod:`.block_attention`);
  - ``"a2a"``: ``AttnFuncWithCPAndQKVOA2A``, DeepSpeed-Ulysses (:mod:`.all_to_all_attention`;
    its exchange is also Megatron-core's ``ssm/mamba_context_parallel.py``
    ``_all_to_all_cp2hp`` / ``_all_to_all_hp2cp``);
  - ``"allgather"``: ``AttnFuncWithCPAndKVAllGather``, Llama 3's CP
    (:mod:`.all_gather_attention`).

  Megatron's fourth type, ``"a2a+p2p"`` (hierarchical: a2a inside a node, ring across), is left
  out. Where TransformerEngine calls flash-attention kernels, this mirror computes the blocks
  in plain torch (the ring needs each block's log-sum-exp) or calls
  ``torch.nn.functional.scaled_dot_product_attention``; collectives go through
  :mod:`mpu_lab.core.comm`. Attention masks other than causal, padding (THD format) and dropout
  inside attention are not supported.

Sources: Liu et al. 2023 (Ring Attention); Jacobs et al. 2023 (DeepSpeed-Ulysses); Llama 3
(Dubey et al. 2024, section 3.3.2); Megatron-core's context-parallel guide
(docs/source/api-guide/context_parallel.rst).
"""
from mpu_lab.core.context_parallel.attention_with_cp import (
    COMM_TYPES, attention, check_attention_inputs)
from mpu_lab.core.context_parallel.layout import (
    chunk_ids, get_batch_on_this_cp_rank, natural_to_rank_order, positions_on_rank,
    rank_order_to_natural, sequence_positions)

__all__ = ["COMM_TYPES", "attention", "check_attention_inputs", "chunk_ids",
           "get_batch_on_this_cp_rank", "natural_to_rank_order", "positions_on_rank",
           "rank_order_to_natural", "sequence_positions"]
