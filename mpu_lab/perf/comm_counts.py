"""Counting collectives from outside the model, with torch's ``CommDebugMode``.

The mirror calls its collectives and nothing else: no counter, no tag. What the labs show —
"2 all-reduces forward and 2 backward per transformer layer" (Shoeybi et al. 2019, §3,
Fig. 4), the all-gathers and reduce-scatters that replace them under sequence parallelism
(Korthikanti et al. 2022, §4.2.2) — is measured here, the way one would measure any PyTorch
program: ``torch.distributed.tensor.debug.CommDebugMode`` is a dispatch mode that sees every
c10d collective (async ones too) and knows which module was running it, in forward or in
backward.

* :class:`CollectiveLog` — ``CommDebugMode`` that also keeps each collective, in order:
  kind, module, pass, the group's global ranks and the bytes of this rank's input.
* :func:`count_collectives` — a GPT training step's collectives labelled as lab 09 prints
  them: ``embedding``, ``layer{n}`` (the layer's ``layer_number``), ``output`` (what
  ``GPTModel`` runs itself, after its decoder: the logits and the loss), each ``.forward`` or
  ``.backward``, and ``grads.sequence_parallel`` for the gradient all-reduce that runs after
  backward. :func:`per_layer_counts` and :func:`format_collectives` summarise it.
* :func:`expected_layer_counts` — the analysis the measurement is compared with.
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from mpu_lab.core.distributed import allreduce_sequence_parallel_grads

# c10d op -> (the name the labs use, index of this rank's input among the op's arguments)
_KINDS = {
    "c10d.allreduce_": ("all_reduce", 0),
    "c10d.allgather_": ("all_gather", 1),
    "c10d.reduce_scatter_": ("reduce_scatter", 1),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d.broadcast_": ("broadcast", 0),
    "c10d.send": ("send", 0),
    "c10d.recv_": ("recv", 0),
    "c10d.alltoall_base_": ("all_to_all", 1),      # all_to_all_single: (output, input, ...)
}


def _nbytes(arg) -> int:
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    return sum(_nbytes(a) for a in arg)       # a list of tensors (or of lists)


def _group_ranks(args) -> List[int]:
    for arg in args:
        if isinstance(arg, torch.ScriptObject):    # the first one is the process group
            return dist.get_process_group_ranks(dist.ProcessGroup.unbox(arg))
    return list(range(dist.get_world_size()))


class CollectiveLog(CommDebugMode):
    """``with CollectiveLog() as log:`` — torch's ``CommDebugMode`` (so ``get_comm_counts()``
    and ``comm_module_counts`` work as documented) that also appends one dict per c10d
    collective or point-to-point message to ``log.events``: ``kind`` (``all_reduce``,
    ``all_gather``, ``reduce_scatter``, ``broadcast``, ``send``, ``recv``), ``module`` (the
    module path ``CommDebugMode`` was in, e.g. ``GPTModel.decoder.layers.0.mlp.linear_fc2``;
    ``Global`` outside any module), ``backward`` (bool), ``group`` (global ranks), ``bytes``
    (this rank's input)."""

    def __init__(self):
        super().__init__()
        self.events: List[dict] = []
        self._forward_hooks: Dict[int, object] = {}
        tracker = self.advanced_module_tracker
        if hasattr(tracker, "_fw_pre_hook") and hasattr(tracker, "register_forward_hook_handles"):
            # torch's tracker (2.11 to 2.13 at least) adds a forward hook to a module each time
            # the module starts and keeps only the last handle per name, so a module that runs
            # twice in one mode (a training loop, micro-batches) ends its forward twice:
            # IndexError. Here each module keeps one hook: the previous one goes first.
            tracker._fw_pre_hook = self._one_forward_hook(tracker._fw_pre_hook)

    def _one_forward_hook(self, pre_hook):
        tracker = self.advanced_module_tracker

        def fw_pre_hook(module, inputs):
            stale = self._forward_hooks.pop(id(module), None)
            if stale is not None:
                stale.remove()
            pre_hook(module, inputs)
            if not tracker.is_bw:     # the hook torch just added for this module
                self._forward_hooks[id(module)] = tracker.register_forward_hook_handles[tracker.name]
        return fw_pre_hook

    def __enter__(self):
        # CommDebugMode's backward hooks warn when a module's inputs need no gradient (an
        # embedding's token ids): true, and harmless here.
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        return super().__enter__()

    def __exit__(self, *args):
        super().__exit__(*args)
        self._quiet.__exit__(*args)
        for handle in self._forward_hooks.values():
            handle.remove()
        self._forward_hooks.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = _KINDS.get(str(getattr(func, "_overloadpacket", "")))
        if kind is not None:
            tracker = self.advanced_module_tracker
            self.events.append(dict(kind=kind[0], module=tracker.name,
                                    backward=bool(tracker.is_bw), group=_group_ranks(args),
                                    bytes=_nbytes(args[kind[1]])))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def count(self, kind: Optional[str] = None, backward: Optional[bool] = None) -> int:
        """How many events of ``kind`` (any when None) in that pass (both when None)."""
        return sum(1 for e in self.events if (kind is None or e["kind"] == kind)
                   and (backward is None or e["backward"] == backward))


def _region(model: torch.nn.Module, module_path: str) -> str:
    """``embedding``, ``layer{n}`` or ``output``: the part of a GPT a module path lies in."""
    parts = module_path.split(".")[1:]          # drop the root's class name
    if parts[:1] == ["embedding"]:
        return "embedding"
    if parts[:2] == ["decoder", "layers"] and len(parts) > 2:
        layer = model.get_submodule(".".join(parts[:3]))
        return f"layer{layer.layer_number}"
    return "output"


def count_collectives(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                      steps: int = 1) -> List[dict]:
    """Run ``steps`` forward+backward passes of a ``GPTModel`` (no optimizer step), then
    :func:`~mpu_lab.core.distributed.allreduce_sequence_parallel_grads`, and return every collective:
    dicts with ``step``, ``tag`` (``layer0.forward``, ``output.backward``, ...,
    ``grads.sequence_parallel``), ``kind``, ``group`` (global ranks) and ``bytes``."""
    events = []
    for step in range(steps):
        with CollectiveLog() as log:
            loss = model(input_ids, labels=labels).mean()
            loss.backward()
        with CollectiveLog() as grads:
            allreduce_sequence_parallel_grads(model)
        model.zero_grad(set_to_none=True)
        for e in log.events:
            tag = f"{_region(model, e['module'])}.{'backward' if e['backward'] else 'forward'}"
            events.append(dict(step=step, tag=tag, kind=e["kind"], group=e["group"],
                               bytes=e["bytes"]))
        events += [dict(step=step, tag="grads.sequence_parallel", kind=e["kind"],
                        group=e["group"], bytes=e["bytes"]) for e in grads.events]
    return events


def per_layer_counts(events: List[dict], step: int = 0) -> Dict[str, Dict[str, int]]:
    """``{tag: {kind: count}}`` for one step, e.g. ``{"layer0.forward": {"all_reduce": 2}}``."""
    table: Dict[str, Dict[str, int]] = {}
    for e in events:
        if e["step"] == step:
            kinds = table.setdefault(e["tag"], {})
            kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    return table


def expected_layer_counts(sequence_parallel: bool, tensor_model_parallel_size: int
                          ) -> Dict[str, Dict[str, int]]:
    """The analysis: collectives of one transformer layer per step, by direction.

    Without sequence parallelism: ``g`` after attention and after the MLP (forward), ``f``
    before QKV and before fc1 (backward) — 2 all-reduces each way. With it, each ``g``
    becomes a reduce-scatter and each ``f`` an all-gather, in both directions (the backward
    of an all-gather is a reduce-scatter and vice versa); and in backward each of the two
    column-parallel linears gathers its input again for its weight gradient, because it kept
    only its ``[s/t, b, h]`` block (Korthikanti et al. 2022, §4.2.2; Megatron's
    ``LinearWithGradAccumulationAndAsyncCommunication``): 2 more all-gathers. Nothing at TP=1.
    """
    if tensor_model_parallel_size == 1:
        return {"forward": {}, "backward": {}}
    if sequence_parallel:
        return {"forward": {"all_gather": 2, "reduce_scatter": 2},
                "backward": {"all_gather": 4, "reduce_scatter": 2}}
    return {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}


def format_collectives(events: List[dict], step: int = 0) -> str:
    """One line per (tag, kind, group): count and bytes of this rank's inputs, in order of
    first use."""
    table: Dict[tuple, List[int]] = {}
    for e in events:
        if e["step"] == step:
            entry = table.setdefault((e["tag"], e["kind"], tuple(e["group"])), [0, 0])
            entry[0] += 1
            entry[1] += e["bytes"]
    lines = [f"{'tag':<26}{'collective':<16}{'group':<16}{'count':>6}{'bytes':>12}"]
    for (tag, kind, group), (n, b) in table.items():
        lines.append(f"{tag:<26}{kind:<16}{str(list(group)):<16}{n:>6}{b:>12}")
    return "\n".join(lines)
