"""The playground of lab 05's exercise: a small model of FSDP units, each started sharded the
way Megatron-FSDP starts a unit (:class:`~mpu_lab.core.distributed.fsdp.ParameterGroup`: the
parameters end to end in one flat buffer padded to a multiple of ``d``, each data-parallel
rank keeping its contiguous ``1/d`` of it), and the dense single-process reference the
grader holds the learner's unit against.

:class:`FsdpUnit` is what the learner's ``my_fully_shard(unit)`` receives. It does the
bookkeeping only (where each parameter lies in the flat buffer, the padding); the learner
writes what makes it FSDP: the all-gathers, the frees, the hooks, the reduce-scatter and the
step on the shard.
"""
from __future__ import annotations

import math
import weakref
from typing import List, Sequence, Tuple

import torch


class Block(torch.nn.Module):
    """One unit's module: ``tanh(x @ weight + bias)``, ``weight`` ``[h_in, h_out]``. ``x @ w``
    saves the parameter itself for backward (not a view of its data, as ``F.linear``'s
    transpose would), so a parameter freed after forward really is gone until it is gathered
    again."""

    def __init__(self, h_in: int, h_out: int, gen: torch.Generator):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(h_in, h_out,  # cpu: moved by blocks()
                                                     generator=gen)
                                         / math.sqrt(h_in))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(  # cpu: moved by blocks()
            h_out, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight + self.bias)          # [b, h_out]


def blocks(sizes: Sequence[int], seed: int, device=None) -> torch.nn.Sequential:
    """``len(sizes) - 1`` units ``sizes[i] -> sizes[i + 1]``, the same on every rank (``seed``)."""
    gen = torch.Generator().manual_seed(seed)          # cpu: a CPU generator, moved below
    return torch.nn.Sequential(*[Block(a, b, gen) for a, b in zip(sizes, sizes[1:])]).to(device)


def batches(sizes: Sequence[int], d: int, samples: int, steps: int, seed: int, device=None
            ) -> List[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """``[step][data-parallel rank] -> (x, y)``: ``samples`` each; every rank builds them all
    (the reference trains on the whole global batch)."""
    gen = torch.Generator().manual_seed(seed)
    cpu = dict(generator=gen, device="cpu")            # cpu: a CPU generator, moved below
    return [[(torch.randn(samples, sizes[0], **cpu).to(device),
              torch.randn(samples, sizes[-1], **cpu).to(device)) for _ in range(d)]
            for _ in range(steps)]


class FsdpUnit:
    """One FSDP unit on this rank, started sharded. ``module``: the unit's module;
    ``params``: its parameters (each ``.data`` empty: freed); ``group``, ``d``, ``rank``: the
    data-parallel group, its size and this rank's place in it; ``numel``: the flat buffer's
    length, padded to a multiple of ``d``; ``shard_numel = numel // d``; ``shard``: this rank's
    ``[rank * shard_numel, (rank + 1) * shard_numel)`` of the flat parameters (what the
    optimizer steps); ``shard_grad``: zeros of the same length, for this rank's shard of the
    averaged gradients (the grader zeroes it before each step)."""

    def __init__(self, module: torch.nn.Module, group, d: int, rank: int):
        self.module, self.group, self.d, self.rank = module, group, d, rank
        self.params = list(module.parameters())
        self.shapes = [p.shape for p in self.params]
        self.numel_unpadded = sum(p.numel() for p in self.params)
        self.numel = -(-self.numel_unpadded // d) * d
        self.shard_numel = self.numel // d
        flat = torch.zeros(self.numel, dtype=torch.float32, device=self.params[0].device)
        with torch.no_grad():
            flat[:self.numel_unpadded].copy_(torch.cat([p.data.reshape(-1) for p in self.params]))
        lo = rank * self.shard_numel
        self.shard = flat[lo:lo + self.shard_numel].clone()
        self.shard_grad = torch.zeros_like(self.shard)
        self.installed: List[weakref.ref] = []        # the grader's view: what install() got
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def install(self, flat: torch.Tensor) -> None:
        """Point every parameter's ``.data`` at its slice of ``flat``, the whole (padded)
        buffer of ``numel`` elements: the unit is unsharded. (Setting ``.data`` keeps
        autograd's bookkeeping: a parameter saved for backward is read again as it is then.)"""
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(f"install needs the whole flat buffer of {self.numel} elements "
                             f"(1-D); got shape {tuple(flat.shape)}")
        self.installed.append(weakref.ref(flat))
        offset = 0
        for p, shape in zip(self.params, self.shapes):
            n = math.prod(shape)
            p.data = flat[offset:offset + n].view(shape)
            offset += n

    def flat_grads(self) -> torch.Tensor:
        """The unit's gradients (each parameter's ``.grad``) end to end, zero-padded to
        ``numel``; the ``.grad`` are dropped (set to None): the flat copy is what is left."""
        flat = torch.zeros(self.numel, dtype=torch.float32, device=self.shard.device)
        offset = 0
        for p, shape in zip(self.params, self.shapes):
            n = math.prod(shape)
            if p.grad is not None:
                flat[offset:offset + n].copy_(p.grad.reshape(-1))
                p.grad = None
            offset += n
        return flat

    def is_whole(self) -> bool:
        """Some parameter holds data (the whole parameters are resident)."""
        return any(p.data.numel() > 0 for p in self.params)

    def gathered_alive(self) -> int:
        """How many of the buffers given to :meth:`install` are still alive."""
        return sum(ref() is not None for ref in self.installed)


def reference_shards(sizes: Sequence[int], data, lr: float, seed: int, d: int, rank: int,
                     device=None) -> Tuple[List[List[torch.Tensor]], List[torch.Tensor]]:
    """The dense single-process reference: the whole model trained with SGD on the whole
    global batch of every step (the mean loss over all ranks' samples). Returns ``(grads,
    params)``: per step, each unit's averaged gradient shard of ``rank`` (before that step's
    update); and each unit's parameter shard of ``rank`` after the last step."""
    model = blocks(sizes, seed, device)
    grads = []
    for step in data:
        x = torch.cat([x for x, _ in step])
        y = torch.cat([y for _, y in step])
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append([_shard(torch.cat([p.grad.reshape(-1) for p in m.parameters()]), d, rank)
                      for m in model])
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    params = [_shard(torch.cat([p.detach().reshape(-1) for p in m.parameters()]), d, rank)
              for m in model]
    return grads, params


def _shard(flat: torch.Tensor, d: int, rank: int) -> torch.Tensor:
    n = -(-flat.numel() // d) * d
    padded = torch.cat([flat, flat.new_zeros(n - flat.numel())])
    return padded[rank * (n // d):(rank + 1) * (n // d)]
