"""The one hook point of :mod:`mpu_lab.core.comm`: how a caller outside the mirror is told of
every call of the package, without replacing any function.

torch's ``CommDebugMode`` and ``torch.profiler`` see the backend's c10d ops from outside; what
they cannot see is the caller's side of a call: the tensor it handed in (the ops see a staged
copy), the call as one call (a pipeline step is several sends and receives), and when it
*waited* for an async result (``Work.wait()`` is no op of the dispatcher). For that a caller
registers a :class:`CommHook` with :func:`register_comm_hook` (torch's DDP offers a hook of
that name for its gradient reduction; Megatron passes ``config.timers`` into its schedules).
:mod:`mpu_lab.perf.comm_timing` times the calls this way.

Each public function of :mod:`mpu_lab.core.comm` and :mod:`mpu_lab.core.comm.exchange` is
declared with :func:`reported` (``@reported("all_reduce")``), and a ``Pending`` reports its
first ``wait()`` (:func:`waiting`). With no hook registered a call costs one check.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import threading
from typing import Any, Callable, Iterator, List, Tuple

import torch
from torch.utils.hooks import RemovableHandle


@dataclasses.dataclass(eq=False)
class Call:
    """One call of the package, as a :class:`CommHook` sees it. ``kind``: the function's name
    without ``_async`` (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``,
    ``all_to_all``, ``send_recv``; ``p2p`` for the pipeline's messages); ``tensors``: the
    caller's tensors (one for a collective, each message sent or received for ``p2p``);
    ``works``: torch's handles, once an async call has been issued."""
    kind: str
    tensors: Tuple[torch.Tensor, ...]
    group: Any = None
    is_async: bool = False
    works: List[Any] = dataclasses.field(default_factory=list)


class CommHook:
    """What :func:`register_comm_hook` takes. Each method returns a context manager (these
    return ones that do nothing; a subclass overrides what it needs):

    * ``call(call)`` is entered just before a call reaches the backend, and left when a
      blocking call has its result, or an async one has been issued (``call.works`` is set);
    * ``wait(call)`` is entered around the first ``wait()`` of an async call's ``Pending``.

    A call made inside another one (a blocking collective waits for its async twin) is not
    reported: the caller made one call."""

    def call(self, call: Call) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def wait(self, call: Call) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


_HOOKS: "collections.OrderedDict[int, CommHook]" = collections.OrderedDict()
_DEPTH = threading.local()      # calls of the package now running on this thread


def register_comm_hook(hook: CommHook) -> RemovableHandle:
    """Tell ``hook`` of every call of :mod:`mpu_lab.core.comm` from now on; ``handle.remove()``
    stops it. Hooks are told in the order they were registered."""
    handle = RemovableHandle(_HOOKS)
    _HOOKS[handle.id] = hook
    return handle


@contextlib.contextmanager
def phase(name: str, call: Call) -> Iterator[Call]:
    """Run the block as ``call``'s ``name`` (``"call"`` or ``"wait"``) inside every registered
    hook's manager for it; nothing more is reported while it runs."""
    depth = getattr(_DEPTH, "value", 0)
    _DEPTH.value = depth + 1
    try:
        with contextlib.ExitStack() as stack:
            if depth == 0:
                for hook in list(_HOOKS.values()):
                    stack.enter_context(getattr(hook, name)(call))
            yield call
    finally:
        _DEPTH.value = depth


def quiet() -> bool:
    """Whether nothing is to be reported now: no hook, or inside a reported call."""
    return not _HOOKS or getattr(_DEPTH, "value", 0) > 0


def waiting(pending) -> contextlib.AbstractContextManager:
    """Around the first ``wait()`` of ``pending``: its ``wait`` phase, where its issue was
    reported (else nothing)."""
    if pending.call is None or quiet():
        return contextlib.nullcontext()
    return phase("wait", pending.call)


def _tensors(first) -> Tuple[torch.Tensor, ...]:
    if isinstance(first, torch.Tensor):
        return (first,)
    return tuple(op.tensor for op in first)      # torch's P2POp messages


def reported(kind: str, is_async: bool = False) -> Callable[[Callable], Callable]:
    """Declare a function of the package (first argument: its tensor, or a list of
    ``P2POp``; ``group`` among its arguments) as a call of ``kind`` that hooks are told of. An
    async one returns a ``Pending``: its handles go into ``call.works`` and the ``Pending``
    keeps the call, to report its ``wait()``."""
    def declare(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            if quiet():
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            first = next(iter(bound.arguments.values()))
            call = Call(kind, _tensors(first), bound.arguments.get("group"), is_async)
            with phase("call", call):
                out = fn(*args, **kwargs)
                if is_async:
                    call.works = list(out.work) if isinstance(out.work, list) else [out.work]
                    out.call = call
            return out
        return run
    return declare
