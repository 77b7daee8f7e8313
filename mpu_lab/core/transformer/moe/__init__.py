"""Mixture of experts, after Megatron-core's ``core/transformer/moe/`` (one module per file of
it, same class names): :class:`TopKRouter` (``router.py``), the token dispatchers
:class:`MoEAlltoAllTokenDispatcher` and :class:`MoEAllGatherTokenDispatcher`
(``token_dispatcher.py``), the experts :class:`SequentialMLP` (``experts.py``), the layer
:class:`MoELayer` (``moe_layer.py``) and the helpers of ``moe_utils.py``.

Sources: Shazeer et al. 2017, "Outrageously Large Neural Networks: The Sparsely-Gated
Mixture-of-Experts Layer"; Lepikhin et al. 2020, "GShard"; Fedus et al. 2021, "Switch
Transformers"; Megatron-core's ``transformer/moe/README.md``.
"""
from mpu_lab.core.transformer.moe.experts import ExpertMLP, SequentialMLP
from mpu_lab.core.transformer.moe.moe_layer import MoELayer, is_expert_parameter
from mpu_lab.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler, apply_router_token_dropping, get_capacity, permute, sort_chunks_by_idxs,
    switch_load_balancing_loss_func, topk_routing_with_score_function, unpermute)
from mpu_lab.core.transformer.moe.router import TopKRouter
from mpu_lab.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher, all_to_all)
