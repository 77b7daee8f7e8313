"""The one place where :mod:`mpu_lab` calls ``torch.distributed`` collectives.

Why one place:

* **Portability.** Only calls that every torch from 2.11 (the floor in requirements.txt) to
  2.15 has, with the same meaning:
  the list-based ``all_gather`` / ``reduce_scatter`` (and ``async_op=True`` for the
  ``*_async`` ones), on gloo and NCCL alike, rather than ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor``, whose gloo support and deprecation notes changed between releases.
  gloo cannot run every collective on CUDA tensors, so when several ranks share one GPU
  through gloo the tensor is staged through host memory here. No version shim is needed
  from 2.11 on.
* **Counting.** Every call is reported to the active :class:`CommCounter`s, which is how the
  labs measure "2 all-reduces forward and 2 backward per layer".
* **Timing.** While a :class:`CommTimer` is active every call is timed (the step-time
  breakdown of :mod:`mpu_lab.perf.measure`).

All functions take ``group`` and return a *new* tensor (inputs are never modified); the
``*_async`` ones return a :class:`Pending` whose ``wait()`` gives it, so a layer can compute
while the transfer runs (Megatron's linear does, in backward).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist


@dataclasses.dataclass
class CommEvent:
    kind: str          # "all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv", ...
    group_ranks: tuple  # global ranks of the group
    bytes: int         # payload of this rank's input tensor
    tag: Optional[str]  # what was active when it ran (e.g. "layer0.forward")


_COUNTERS: List["CommCounter"] = []
_TAGS: List[str] = []


class CommCounter:
    """Records every collective issued through :mod:`mpu_lab.comm` while it is active.

    >>> with CommCounter() as counter:          # doctest: +SKIP
    ...     out = layer(x)
    >>> counter.count("all_reduce")             # doctest: +SKIP
    """

    def __init__(self):
        self.events: List[CommEvent] = []

    def __enter__(self):
        _COUNTERS.append(self)
        return self

    def __exit__(self, *exc):
        _COUNTERS.remove(self)
        return False

    def count(self, kind: Optional[str] = None, tag: Optional[str] = None) -> int:
        return sum(1 for e in self.events
                   if (kind is None or e.kind == kind) and (tag is None or e.tag == tag))

    def summary(self):
        """``{(tag, kind): (count, bytes)}`` for printing."""
        table = {}
        for e in self.events:
            n, b = table.get((e.tag, e.kind), (0, 0))
            table[(e.tag, e.kind)] = (n + 1, b + e.bytes)
        return table


@contextlib.contextmanager
def comm_tag(tag: str):
    """Label the collectives issued inside the block (e.g. per layer and direction)."""
    _TAGS.append(tag)
    try:
        yield
    finally:
        _TAGS.pop()


# --------------------------------------------------------------------------- backward tags
# Autograd runs a layer's backward long after its forward ``with comm_tag(...)`` block has
# closed, so a tag for the backward pass is planted in the graph at forward time: an identity
# autograd Function at the region's *output* sets the tag when the gradient reaches it (the
# region's backward starts), one at the region's *input* clears it (the backward has left).
_BACKWARD_TAG: List[Optional[str]] = [None]


class _EnterBackwardRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tag):
        ctx.tag = tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _BACKWARD_TAG[0] = ctx.tag
        return grad, None


class _LeaveBackwardRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tag):
        ctx.tag = tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _BACKWARD_TAG[0] == ctx.tag:
            _BACKWARD_TAG[0] = None
        return grad, None


def _compiling() -> bool:
    # Under torch.compile the tags are left out (a side effect in backward breaks the graph).
    return bool(torch.compiler.is_compiling())


def tag_backward_output(tensor: torch.Tensor, tag: str) -> torch.Tensor:
    """Apply to a region's output in forward: its backward collectives are labelled ``tag``.

    Identity in forward; in backward it sets the tag that :func:`_record` uses when no
    :func:`comm_tag` block is open. A no-op when ``tensor`` does not require grad.
    """
    if torch.is_grad_enabled() and tensor.requires_grad and not _compiling():
        return _EnterBackwardRegion.apply(tensor, tag)
    return tensor


def tag_backward_input(tensor: torch.Tensor, tag: str) -> torch.Tensor:
    """Apply to a region's input in forward: when the backward pass reaches it the region's
    backward is over and the tag ``tag`` (set by :func:`tag_backward_output`) is cleared."""
    if torch.is_grad_enabled() and tensor.requires_grad and not _compiling():
        return _LeaveBackwardRegion.apply(tensor, tag)
    return tensor


def clear_backward_tag() -> None:
    """Forget a backward tag left over from a region without an input marker (e.g. the
    embedding, whose input ids need no gradient)."""
    _BACKWARD_TAG[0] = None


def current_tag() -> Optional[str]:
    """The tag a collective issued now would get."""
    return _TAGS[-1] if _TAGS else _BACKWARD_TAG[0]


def _record(kind, group, tensor):
    if not _COUNTERS:
        return
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    event = CommEvent(kind, ranks, tensor.numel() * tensor.element_size(), current_tag())
    for counter in _COUNTERS:
        counter.events.append(event)


# --------------------------------------------------------------------------- timing
_TIMERS: List["CommTimer"] = []


class CommTimer:
    """Wall-clock seconds spent inside the calls of :mod:`mpu_lab.comm` (and the pipeline's p2p
    messages) while it is active, per ``(kind, group ranks, tag)``.

    A blocking collective returns when the *last* rank of the group has arrived, so its time is
    the transfer plus the wait for the slowest peer. With ``barrier=True`` a barrier on the group
    runs first and is booked apart as ``wait``: what remains is closer to the transfer itself
    (Megatron's timers offer the same switch, ``--barrier-with-L1-time``); p2p messages get no
    barrier. On CUDA each timed call is bracketed by ``torch.cuda.synchronize()``, so queued
    kernels are not billed to the collective (that removes any overlap: the run gets slower).
    """

    def __init__(self, barrier: bool = False):
        self.barrier = barrier
        # (kind, group ranks, tag) -> [calls, seconds in the call, seconds in the barrier, bytes]
        self.totals: Dict[tuple, List[float]] = {}

    def __enter__(self):
        _TIMERS.append(self)
        return self

    def __exit__(self, *exc):
        _TIMERS.remove(self)
        return False

    def add(self, key: tuple, seconds: float, wait_s: float, nbytes: int) -> None:
        entry = self.totals.setdefault(key, [0, 0.0, 0.0, 0])
        entry[0] += 1
        entry[1] += seconds
        entry[2] += wait_s
        entry[3] += nbytes

    def seconds(self) -> float:
        """Everything booked so far, barriers included."""
        return sum(e[1] + e[2] for e in self.totals.values())


def _timed(kind: str, group, tensor: torch.Tensor, call: Callable[[], Any]) -> Any:
    """Run ``call()`` (the ``torch.distributed`` call of a collective); time it for the active
    :class:`CommTimer`s."""
    if not _TIMERS:
        return call()
    sync = tensor.is_cuda
    wait_s = 0.0
    if sync:
        torch.cuda.synchronize(tensor.device)
    if kind != "p2p" and any(t.barrier for t in _TIMERS):
        start = time.perf_counter()
        dist.barrier(group=group)
        wait_s = time.perf_counter() - start
    start = time.perf_counter()
    out = call()
    if sync:
        torch.cuda.synchronize(tensor.device)
    seconds = time.perf_counter() - start
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None \
        else tuple(range(dist.get_world_size()))
    key = (kind, ranks, current_tag())
    for timer in _TIMERS:
        timer.add(key, seconds, wait_s, tensor.numel() * tensor.element_size())
    return out


def group_size(group) -> int:
    return dist.get_world_size(group=group)


def _to_backend(tensor: torch.Tensor, group):
    """``(tensor the backend can take, device to return the result to or None)``.

    gloo cannot run every collective on CUDA tensors (several ranks sharing one GPU), so
    there the tensor goes through host memory; everywhere else it is used as it is.
    """
    if tensor.is_cuda and dist.get_backend(group) == "gloo":
        return tensor.cpu(), tensor.device
    return tensor, None


def _from_backend(tensor: torch.Tensor, device) -> torch.Tensor:
    return tensor if device is None else tensor.to(device)


def all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or ``op``) of ``tensor`` over ``group``; every rank gets the result."""
    _record("all_reduce", group, tensor)
    work, device = _to_backend(tensor.detach().clone().contiguous(), group)
    _timed("all_reduce", group, work, lambda: dist.all_reduce(work, op=op, group=group))
    return _from_backend(work, device)


def all_gather(tensor: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``, in group-rank order."""
    _record("all_gather", group, tensor)
    src, device = _to_backend(tensor.detach().contiguous(), group)
    parts = [torch.empty_like(src) for _ in range(group_size(group))]
    _timed("all_gather", group, src, lambda: dist.all_gather(parts, src, group=group))
    return _from_backend(torch.cat(parts, dim=dim), device)


def _scatter_size(tensor: torch.Tensor, group, dim: int) -> int:
    """The group size, after checking that ``dim`` of ``tensor`` splits into that many chunks."""
    n = group_size(group)
    if tensor.size(dim) % n:
        raise ValueError(f"reduce_scatter: size {tensor.size(dim)} of dim {dim} is not divisible "
                         f"by the group size {n}")
    return n


def reduce_scatter(tensor: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """Sum over ``group``, then keep this rank's chunk of ``dim`` (chunks in group-rank order)."""
    _record("reduce_scatter", group, tensor)
    n = _scatter_size(tensor, group, dim)
    src, device = _to_backend(tensor.detach(), group)
    if dist.get_backend(group) == "gloo":
        # gloo's reduce_scatter is several times slower than its all-reduce when ranks share
        # CPU cores (measured: 25 ms vs 7 ms for 4 ranks on 2 cores), so on gloo the same
        # result is computed as an all-reduce followed by keeping this rank's chunk.
        full = src.contiguous().clone()
        _timed("reduce_scatter", group, full, lambda: dist.all_reduce(full, group=group))
        out = torch.chunk(full, n, dim=dim)[dist.get_rank(group=group)].contiguous()
    else:
        chunks = [c.contiguous() for c in torch.chunk(src, n, dim=dim)]
        out = torch.empty_like(chunks[0])
        _timed("reduce_scatter", group, src,
               lambda: dist.reduce_scatter(out, chunks, group=group))
    return _from_backend(out, device)


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """``tensor`` of global rank ``src``, on every rank of ``group`` (a new tensor)."""
    _record("broadcast", group, tensor)
    work, device = _to_backend(tensor.detach().clone().contiguous(), group)
    _timed("broadcast", group, work, lambda: dist.broadcast(work, src=src, group=group))
    return _from_backend(work, device)


# --------------------------------------------------------------------------- asynchronous
_SERIAL: List[bool] = []


@contextlib.contextmanager
def no_overlap():
    """Inside the block every ``*_async`` collective is finished before it returns, so nothing
    overlaps it: the baseline that measures what overlapping saves."""
    _SERIAL.append(True)
    try:
        yield
    finally:
        _SERIAL.pop()


class Pending:
    """A collective in flight (``torch.distributed``'s ``async_op=True``): :meth:`wait` blocks
    until it is done and returns its result. gloo runs it on its own thread and NCCL on its own
    stream, so whatever the caller computes before ``wait()`` overlaps the transfer. While a
    :class:`CommTimer` is active, only the time spent in ``wait()`` is booked: the part of the
    transfer the computation did not hide."""

    def __init__(self, kind: str, group, work, finish: Callable[[], torch.Tensor], nbytes: int):
        self.kind, self.group, self._work, self._finish, self._nbytes = kind, group, work, finish, nbytes
        self._result: Optional[torch.Tensor] = None
        self.issued_at = time.perf_counter()
        self.done_at: Optional[float] = None   # when it was known to be finished
        # when the backend finished it (its future's callback), even if nobody waited yet
        self.completed_at: Optional[float] = None
        future = work.get_future() if hasattr(work, "get_future") else None
        if future is not None:
            future.add_done_callback(self._completed)
        if _SERIAL:                 # no_overlap(): done before the caller computes anything
            self._work.wait()
            self.done_at = time.perf_counter()

    def _completed(self, _future) -> None:
        if self.completed_at is None:
            self.completed_at = time.perf_counter()

    def wait(self) -> torch.Tensor:
        if self._result is None:
            start = time.perf_counter()
            self._work.wait()
            self.done_at = self.done_at or time.perf_counter()
            self._result = self._finish()
            if _TIMERS:
                ranks = tuple(dist.get_process_group_ranks(self.group)) if self.group is not None \
                    else tuple(range(dist.get_world_size()))
                for timer in _TIMERS:
                    timer.add((self.kind, ranks, current_tag()), time.perf_counter() - start, 0.0,
                              self._nbytes)
        return self._result


def all_gather_async(tensor: torch.Tensor, group=None, dim: int = 0) -> Pending:
    """:func:`all_gather`, started and not waited for."""
    _record("all_gather", group, tensor)
    src, device = _to_backend(tensor.detach().contiguous(), group)
    parts = [torch.empty_like(src) for _ in range(group_size(group))]
    work = dist.all_gather(parts, src, group=group, async_op=True)
    return Pending("all_gather", group, work,
                   lambda: _from_backend(torch.cat(parts, dim=dim), device),
                   tensor.numel() * tensor.element_size())


def all_reduce_async(tensor: torch.Tensor, group=None) -> Pending:
    """:func:`all_reduce` (a sum), started and not waited for."""
    _record("all_reduce", group, tensor)
    work_tensor, device = _to_backend(tensor.detach().clone().contiguous(), group)
    work = dist.all_reduce(work_tensor, group=group, async_op=True)
    return Pending("all_reduce", group, work, lambda: _from_backend(work_tensor, device),
                   tensor.numel() * tensor.element_size())


def reduce_scatter_async(tensor: torch.Tensor, group=None, dim: int = 0) -> Pending:
    """:func:`reduce_scatter`, started and not waited for (on gloo, as there, an all-reduce
    of which this rank keeps its chunk)."""
    _record("reduce_scatter", group, tensor)
    n = _scatter_size(tensor, group, dim)
    src, device = _to_backend(tensor.detach(), group)
    nbytes = tensor.numel() * tensor.element_size()
    if dist.get_backend(group) == "gloo":
        full = src.contiguous().clone()
        work = dist.all_reduce(full, group=group, async_op=True)
        me = dist.get_rank(group=group)
        return Pending("reduce_scatter", group, work, lambda: _from_backend(
            torch.chunk(full, n, dim=dim)[me].contiguous(), device), nbytes)
    chunks = [c.contiguous() for c in torch.chunk(src, n, dim=dim)]
    out = torch.empty_like(chunks[0])
    work = dist.reduce_scatter(out, chunks, group=group, async_op=True)
    return Pending("reduce_scatter", group, work, lambda: _from_backend(out, device), nbytes)


# --------------------------------------------------------------------------- context parallel
def all_to_all(tensor: torch.Tensor, group=None, scatter_dim: int = 0,
               gather_dim: int = 0) -> torch.Tensor:
    """Cut ``tensor`` into one chunk per rank of ``group`` along ``scatter_dim``; chunk ``j`` goes
    to group rank ``j``, and the chunks received (from group ranks 0, 1, ...) are concatenated
    along ``gather_dim``. Megatron-core's ``tensor_parallel.mappings.all_to_all`` with the split
    and the concatenation dims named: sequence-split to head-split and back (Ulysses, and
    ``--cp-comm-type a2a``). One ``all_to_all_single`` (gloo and NCCL, torch 2.11 to 2.15)."""
    n = group_size(group)
    if tensor.size(scatter_dim) % n:
        raise ValueError(f"all_to_all: size {tensor.size(scatter_dim)} of dim {scatter_dim} is not "
                         f"divisible by the group size {n}")
    src, device = _to_backend(tensor.detach(), group)
    send = torch.stack(torch.chunk(src, n, dim=scatter_dim)).contiguous()   # [n, *chunk]
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return _from_backend(torch.cat(received.unbind(0), dim=gather_dim), device)


class Exchange:
    """A :func:`send_recv_async` in flight: :meth:`wait` blocks until both messages are done and
    returns the tensor received."""

    def __init__(self, works, sent: torch.Tensor, received: torch.Tensor, device):
        self._works, self._sent, self._received, self._device = list(works), sent, received, device

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], None      # the send buffer may be freed now
        return _from_backend(self._received, self._device)


def send_recv_async(tensor: torch.Tensor, dst: int, src: int, group=None, tag: int = 0) -> Exchange:
    """Send ``tensor`` to group rank ``dst`` and receive one of the same shape and dtype from
    group rank ``src`` (a ring step: ``dst`` the next rank, ``src`` the previous one), started
    and not waited for, so the caller computes while the messages travel."""
    ranks = (dist.get_process_group_ranks(group) if group is not None
             else list(range(dist.get_world_size())))
    sent, device = _to_backend(tensor.detach().contiguous(), group)
    received = torch.empty_like(sent)
    if dist.get_backend(group) == "gloo":
        # plain isend/irecv in the same order on every rank: gloo's isend does not wait for the
        # receiver, and batch_isend_irecv is not dependable on gloo.
        works = [dist.isend(sent, ranks[dst], group=group, tag=tag),
                 dist.irecv(received, ranks[src], group=group, tag=tag)]
    else:
        # NCCL: one grouped call, so two ranks sending to each other never wait on each other.
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, ranks[dst], group, tag),
                                        dist.P2POp(dist.irecv, received, ranks[src], group, tag)])
    return Exchange(works, sent, received, device)


def send_recv(tensor: torch.Tensor, dst: int, src: int, group=None, tag: int = 0) -> torch.Tensor:
    """:func:`send_recv_async`, waited for: the tensor received from group rank ``src``."""
    return send_recv_async(tensor, dst, src, group, tag).wait()
