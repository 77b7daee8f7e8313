"""What a run with mixture-of-experts layers logs besides the loss (Megatron's
``track_moe_metrics``, reduced to its load-balancing loss): :func:`load_balancing_loss`, the
Switch auxiliary loss of the step's last micro-batch, divided by its coefficient (1 when the
load is uniform; up to E when one expert gets every token), averaged over the MoE layers and
the data-parallel replicas."""
from __future__ import annotations

from typing import Optional

import torch

from mpu_lab.core import comm, parallel_state
from mpu_lab.training import initialize
from mpu_lab.core.transformer.moe import TopKRouter


def load_balancing_loss(model_chunks) -> Optional[float]:
    """The mean over layers and replicas of the routers' last load-balancing loss, or None
    when no router computed one (no ``--moe-aux-loss-coeff``). Collective over the
    model-parallel and data-parallel groups: every rank calls it.

    Each tensor-parallel rank's loss holds its own tokens' share of the router probabilities
    (sequence parallelism), so the parts are summed over the model-parallel group (tensor x
    pipeline, whose stages hold the other layers); the count of layers is summed over the
    pipeline only."""
    routers = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
    losses = [r.load_balancing_loss for r in routers if r.load_balancing_loss is not None]
    device = initialize.get_device()
    total = torch.stack(losses).sum().float() if losses else torch.zeros((), device=device)
    layers = torch.tensor(float(len(losses)) if
                          parallel_state.get_tensor_model_parallel_rank() == 0 else 0.0,
                          device=device)
    both = torch.stack([total.to(device), layers])
    mp_group = parallel_state.get_model_parallel_group()
    if comm.group_size(mp_group) > 1:
        both = comm.all_reduce(both, group=mp_group)
    dp_group = parallel_state.get_data_parallel_group()
    if comm.group_size(dp_group) > 1:
        both = comm.all_reduce(both, group=dp_group) / comm.group_size(dp_group)
    if float(both[1]) == 0:
        return None
    return float(both[0] / both[1])
