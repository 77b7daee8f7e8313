"""Fully sharded data parallelism the way Megatron-FSDP does it: a hand-written teaching
mirror of ``megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py``
(``MegatronFSDP``) for the two strategies that shard more than the optimizer states
(``--data-parallel-sharding-strategy``):

* ``optim_grads`` (ZeRO-2, Rajbhandari et al. 2020, §5.2 "P_os+g"): each unit's gradients are
  **reduce-scattered** as soon as its backward is done; a rank keeps the averaged gradients of
  its shard only (``main_grad``, ``numel / d``) and steps its shard of the parameters; the
  updated shards are all-gathered back into every rank's whole parameters after the step
  (:meth:`MegatronFSDP.install_optimized_model_weights`).
* ``optim_grads_params`` (ZeRO-3, §5.3 "P_os+g+p"; FSDP, Zhao et al. 2023, §3.2): the
  parameters too live as shards. A unit's whole parameters are **all-gathered** just before
  its forward and freed after it, gathered **again** before its backward (a hook on the
  unit's output fires when the output's gradient is ready) and freed once its gradients are
  reduce-scattered. The next unit's all-gather is started before this unit computes
  (prefetch), in forward order during forward and in backward order during backward.

Per step and rank, with ``Ψ`` the elements of the (padded) units and ring collectives:
``optim_grads`` moves ``(d-1)/d Ψ`` in reduce-scatters and ``(d-1)/d Ψ`` in all-gathers
(the all-reduce's ``2(d-1)/d Ψ``); ``optim_grads_params`` two all-gathers and one
reduce-scatter, ``3(d-1)/d Ψ`` — 1.5 x data parallelism's bytes for ``1/d`` of its memory.

The units (Megatron's ``fsdp_unit_modules``, the knob of their size): every module of one of
those classes not inside another unit; ``TransformerLayer`` gives one unit per layer,
``TransformerBlock`` one for the whole stack. The parameters that belong to no unit form the
**root** unit (unit 0): the embeddings, the final LayerNorm and the output layer tied to the
word embedding, which GPTModel uses at both ends of its forward — gathered at the model's
forward and again at the start of its backward, reduced at the end of backward.

Memory beyond the shards (transient, during a step): under ``optim_grads_params`` the whole
parameters of the unit computing, of the one prefetched and of the root (an op that saved a
*view* of a weight for backward, as ``F.linear``'s transpose of the tied output weight, keeps
that view until backward; the mirror's layers save the parameter itself, read again once
re-gathered). Under ``optim_grads`` the whole gradients of the unit whose backward just ended
and of the one whose reduce-scatter is in flight (one at a time), and the root's until the end
of backward: with large units — one ``TransformerBlock`` unit holds every layer's gradients at
once — that exceeds the one persistent gradient buffer of ``optim``, which is how
``optim_grads`` can peak above ``optim`` though it keeps less between steps.

``no_shard`` and ``optim`` shard no gradient and no parameter: they are data parallelism and
Megatron's distributed optimizer,
:class:`~mpu_lab.core.distributed.distributed_data_parallel.DistributedDataParallel`
(``use_distributed_optimizer`` for ``optim``), see :mod:`mpu_lab.core.distributed.fsdp`.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, List, Sequence, Tuple, Type

import torch
import torch.distributed as dist

from mpu_lab.core import comm
from mpu_lab.core.distributed.fsdp.param_and_grad_buffer import AllGatherPipeline, ParameterGroup

DATA_PARALLEL_SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
SHARDED_GRADIENT_STRATEGIES = ("optim_grads", "optim_grads_params")


def fsdp_units(module: torch.nn.Module, fsdp_unit_modules: Sequence[Type[torch.nn.Module]]
               ) -> List[torch.nn.Module]:
    """The FSDP units of ``module``, in forward (registration) order: each submodule of one of
    the ``fsdp_unit_modules`` classes that is not inside another such submodule."""
    units: List[torch.nn.Module] = []
    classes = tuple(fsdp_unit_modules)

    def visit(m: torch.nn.Module) -> None:
        for child in m.children():
            if classes and isinstance(child, classes):
                units.append(child)
            else:
                visit(child)
    visit(module)
    return units


class MegatronFSDP(torch.nn.Module):
    """Wrap ``module`` for ``optim_grads`` or ``optim_grads_params`` over
    ``data_parallel_group`` (default: the world), one flat :class:`ParameterGroup` per unit
    (see the module docstring). ``forward`` is ``module``'s: the hooks sit on ``module`` and
    its units, so calling ``module`` directly works the same. A step:
    :meth:`zero_grad_buffer`, the micro-batches' forward and backward, :meth:`finish_grad_sync`,
    the optimizer on :meth:`optimizer_shards`, :meth:`install_optimized_model_weights`."""

    def __init__(self, module: torch.nn.Module, data_parallel_group=None,
                 data_parallel_sharding_strategy: str = "optim_grads_params",
                 fsdp_unit_modules: Sequence[Type[torch.nn.Module]] = ()):
        super().__init__()
        if data_parallel_sharding_strategy not in SHARDED_GRADIENT_STRATEGIES:
            raise ValueError(
                f"MegatronFSDP shards gradients: data_parallel_sharding_strategy must be one of "
                f"{SHARDED_GRADIENT_STRATEGIES}, got {data_parallel_sharding_strategy!r} (no_shard "
                f"and optim are DistributedDataParallel, with use_distributed_optimizer=True "
                f"for optim)")
        self.module = module
        self.data_parallel_sharding_strategy = data_parallel_sharding_strategy
        self.data_parallel_group = data_parallel_group
        self.data_parallel_size = comm.group_size(data_parallel_group)
        self.data_parallel_rank = dist.get_rank(group=data_parallel_group) \
            if data_parallel_group is not None else dist.get_rank()
        self.shard_params = data_parallel_sharding_strategy == "optim_grads_params"
        self.fsdp_unit_modules = list(fsdp_unit_modules)
        # unit 0 is the root (what no unit holds), then the units in forward order
        self.unit_modules = [module] + fsdp_units(module, self.fsdp_unit_modules)
        in_units = {id(p) for m in self.unit_modules[1:] for p in m.parameters()}
        root_params = [p for p in module.parameters() if id(p) not in in_units]
        self.parameter_groups = [ParameterGroup(
            root_params if i == 0 else list(m.parameters()), i, self.data_parallel_size,
            self.data_parallel_rank, self.shard_params) for i, m in enumerate(self.unit_modules)]
        self.main_device = self.parameter_groups[0].main_grad.device
        self.all_gather_pipeline = AllGatherPipeline(self.parameter_groups, data_parallel_group)
        self._group_of = {id(p): g for g in self.parameter_groups for p in g.params}
        self._grad_counts = [0] * len(self.parameter_groups)
        self._pending_reduce: List[Tuple[ParameterGroup, comm.Pending]] = []
        self._hooks: list = []
        # Megatron's TrainingState.PRE_BACKWARD: from the loss's gradient to the next forward.
        # A unit's forward then is a recomputation (--recompute-granularity full): its whole
        # parameters stay for the backward that follows, and nothing is prefetched forward.
        self._in_backward = False
        self._register_fsdp_hooks()
        self.zero_grad_buffer()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ hooks
    def _register_fsdp_hooks(self) -> None:
        """Megatron-FSDP's four hooks per unit: unshard before forward (and prefetch the next
        unit), reshard after forward and arm the pre-backward hook on the output, unshard
        before backward (and prefetch the unit backward reaches next), and, once every
        parameter of the unit has its gradient, reduce-scatter them and reshard."""
        for group, m in zip(self.parameter_groups, self.unit_modules):
            if self.shard_params:
                self._hooks.append(m.register_forward_pre_hook(self._pre_forward(group)))
                self._hooks.append(m.register_forward_hook(self._post_forward(group)))
        for group in self.parameter_groups:
            for p in group.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_acc(group)))

    def _pre_forward(self, group: ParameterGroup):
        def hook(module, args):
            if group.fsdp_unit_id == 0:
                self._in_backward = False
            self.all_gather_pipeline.wait_bucket_ready(group)
            following = group.fsdp_unit_id + 1                 # forward order
            if following < len(self.parameter_groups) and not self._in_backward:
                self.all_gather_pipeline.async_bucket_gather(self.parameter_groups[following])
        return hook

    def _post_forward(self, group: ParameterGroup):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                armed = [False]

                def pre_backward(grad):
                    if not armed[0]:
                        armed[0] = True
                        self._pre_backward(group)
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(pre_backward)
            if not self._in_backward:
                self.all_gather_pipeline.release_bucket(group)
        return hook

    def _pre_backward(self, group: ParameterGroup) -> None:
        if group.fsdp_unit_id == 0:
            self._in_backward = True
        self.all_gather_pipeline.wait_bucket_ready(group)
        # backward order: the root (its output is the loss), then the units last to first
        following = len(self.parameter_groups) - 1 if group.fsdp_unit_id == 0 \
            else group.fsdp_unit_id - 1
        if following > 0:
            self.all_gather_pipeline.async_bucket_gather(self.parameter_groups[following])

    def _grad_acc(self, group: ParameterGroup):
        def hook(param: torch.nn.Parameter) -> None:
            self._grad_counts[group.fsdp_unit_id] += 1
            if self._grad_counts[group.fsdp_unit_id] == len(group.params):
                self._post_backward(group)
        return hook

    def _post_backward(self, group: ParameterGroup) -> None:
        """The unit's backward is done: start the reduce-scatter of its gradients (waited for
        in :meth:`finish_grad_sync`, so it overlaps the backward of the units before it) and,
        under ZeRO-3, free its whole parameters."""
        self._grad_counts[group.fsdp_unit_id] = 0
        flat = group.flat_grad()
        if self.data_parallel_size > 1:
            # at most one reduce-scatter in flight: each holds a whole unit's gradients
            # until it lands (Megatron's wait_for_previous_grad_reduce)
            self._wait_for_previous_grad_reduce(keep=0)
            self._pending_reduce.append(
                (group, comm.reduce_scatter_async(flat, self.data_parallel_group)))
        else:
            group.main_grad.add_(flat)
        if self.shard_params:
            self.all_gather_pipeline.release_bucket(group)

    # ------------------------------------------------------------------ a step
    def zero_grad_buffer(self) -> None:
        """Before a step: zero every unit's gradient shard; no reduction pending."""
        for group in self.parameter_groups:
            group.main_grad.zero_()
            for p in group.params:
                p.grad = None
        self._grad_counts = [0] * len(self.parameter_groups)
        self._pending_reduce = []

    def finish_grad_sync(self, late: bool = False) -> None:
        """Reduce the units whose backward left a gradient unreduced (a parameter that got
        none), wait for every reduce-scatter and add each average (sum / d) into the unit's
        ``main_grad`` shard. ``late`` (the distributed optimizer's late buckets) has nothing
        to do here: sequence parallelism and pipeline stages are refused with FSDP."""
        if late:
            return
        for group in self.parameter_groups:
            if self._grad_counts[group.fsdp_unit_id]:
                self._post_backward(group)
        self._wait_for_previous_grad_reduce(keep=0)
        if self.shard_params:      # nothing whole left over, no gather pending into the step
            self.all_gather_pipeline.release_all()

    def _wait_for_previous_grad_reduce(self, keep: int) -> None:
        """Wait for the reduce-scatters in flight but the last ``keep``, adding each average
        (sum / d) into its unit's ``main_grad`` shard."""
        while len(self._pending_reduce) > keep:
            group, pending = self._pending_reduce.pop(0)
            group.main_grad.add_(pending.wait().div_(self.data_parallel_size))

    def install_optimized_model_weights(self) -> None:
        """After the optimizer stepped the shards: under ``optim_grads`` all-gather them into
        every rank's whole parameters; under ``optim_grads_params`` nothing (the shards are
        the parameters; the next forward gathers them)."""
        if self.shard_params or self.data_parallel_size == 1:
            return
        for group in self.parameter_groups:
            if group.params:
                group.model_weight.copy_(comm.all_gather(group.main_weight,
                                                         self.data_parallel_group))

    def parameter_group(self, param: torch.nn.Parameter) -> ParameterGroup:
        """The unit (:class:`ParameterGroup`) that holds ``param``."""
        return self._group_of[id(param)]

    def optimizer_shards(self) -> List[Tuple[torch.nn.Parameter, torch.Tensor, int, int]]:
        """``(model parameter, shard, a, b)`` for every piece of a parameter this rank owns:
        ``shard`` is a view of the unit's ``main_weight`` holding ``param.view(-1)[a:b]``, its
        ``.grad`` the same view of ``main_grad`` (Megatron's ``_init_optimizer_named_parameters``:
        the optimizer steps the distributed parameters)."""
        out = []
        for group in self.parameter_groups:
            for p in group.params:
                owned = group.shard_range(p)
                if owned is None:
                    continue
                start, _ = group.param_range(p)
                lo = start + owned[0] - group.shard_start
                hi = start + owned[1] - group.shard_start
                shard = group.main_weight[lo:hi]
                shard.grad = group.main_grad[lo:hi]
                out.append((p, shard, owned[0], owned[1]))
        return out

    @contextlib.contextmanager
    def unsharded_parameters(self):
        """Inside: every parameter whole (``optim_grads_params`` gathers them all; collective).
        On leaving, each rank's shard is taken back from the whole parameters (what a
        checkpoint load wrote into them) and they are freed."""
        if not self.shard_params:
            yield
            return
        self.all_gather_pipeline.gather_all()
        try:
            yield
        finally:
            with torch.no_grad():
                for group in self.parameter_groups:
                    for p in group.params:
                        owned = group.shard_range(p)
                        if owned is not None:
                            start, _ = group.param_range(p)
                            lo = start + owned[0] - group.shard_start
                            group.main_weight[lo:lo + owned[1] - owned[0]].copy_(
                                p.data.reshape(-1)[owned[0]:owned[1]])
            self.all_gather_pipeline.release_all()

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)


@contextlib.contextmanager
def unsharded_parameters(modules: Iterable[torch.nn.Module]):
    """:meth:`MegatronFSDP.unsharded_parameters` of each :class:`MegatronFSDP` in
    ``modules`` (others are left alone): the whole parameters, for a checkpoint."""
    with contextlib.ExitStack() as stack:
        for m in modules:
            if isinstance(m, MegatronFSDP):
                stack.enter_context(m.unsharded_parameters())
        yield


def _tensors(output) -> List[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in _tensors(o)]
    return []
