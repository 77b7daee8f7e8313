"""The engine side of a playground world: functions that run inside the ipyparallel engines.

The controller sends them by reference (ipyparallel pickles a function as its code plus the
name of its module; the engine imports this module and runs the code with its globals), so
everything they use lives here, and every engine imports this module and the modules it
imports (torch, :mod:`mpu_lab.core.tensor_parallel`) when the first function arrives.
"""
from __future__ import annotations

import ast
import contextlib
import io
import linecache
import os
import pickle
import re
import traceback
from typing import Any, Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

import mpu_lab
from mpu_lab.core import comm, parallel_state, tensor_parallel
from mpu_lab.training import initialize
from mpu_lab.core.tensor_parallel import mappings
from mpu_lab.labkit.playground.owner import watch_owner

# What a rank that was inside a collective or a send/receive raises when the wait ends: its own
# timeout, or the connection its peer closed on timing out first.
_TIMEOUT_TEXT = re.compile(r"timed out|timeout|connection closed by peer|connection reset by peer",
                           re.I)
_TORCH_DISTRIBUTED = f"{os.sep}torch{os.sep}distributed{os.sep}"


def _waited_in_collective(exc: BaseException) -> bool:
    """Did this rank fail while it was inside a ``torch.distributed`` call, i.e. had it
    arrived at the collective? Read from where the rank stood (its traceback), not from the
    error's wording: the first rank to time out says "Timed out", but its peers may get
    "Connection closed by peer" a moment later, depending on timing. Both backends raise a
    RuntimeError (DistBackendError) there. A pipeline stage waits in ``Work.wait()`` of a
    send or receive it started, which has no torch.distributed frame in the traceback: the
    backend's error class (DistBackendError, torch >= 2.1) and its wording say it waited (seen
    with torch 2.15.0: "Connection closed by peer" on a stage whose neighbour timed out
    first)."""
    if isinstance(exc, dist.DistBackendError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    frames = [f.f_code.co_filename for f, _ in traceback.walk_tb(exc.__traceback__)]
    return any(_TORCH_DISTRIBUTED in name for name in frames) or bool(
        _TIMEOUT_TEXT.search(str(exc)))


def engine_env(rank: int, world_size: int, port: int, timeout_s: float) -> Dict[str, str]:
    """The environment of the engine that is ``rank``: torchrun's variables, as a one-node
    ``torchrun --nproc-per-node world_size`` gives its workers (``LOCAL_RANK`` = rank), so
    :func:`mpu_lab.training.initialize.init` takes the same decision as in a launched job: NCCL and
    ``cuda:LOCAL_RANK`` when every engine has a GPU of its own, gloo with
    ``cuda:LOCAL_RANK % GPUs`` when the engines share GPUs, gloo on the CPU without one."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "MPU_LAB_TIMEOUT_S": str(timeout_s),
            # NCCL runs collectives asynchronously and, by default, a watchdog ends the
            # process when one times out; blocking wait makes the cell that waits raise the
            # timeout instead, as gloo does, so CollectiveTimeout and restart() work the same.
            # (Read by NCCL only; a value set in the notebook's environment is kept.)
            "TORCH_NCCL_BLOCKING_WAIT": os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "1")}


def engine_setup(env: Dict[str, str], owner: Optional[Dict[str, Any]] = None) -> int:
    """Put torchrun's variables in this engine's environment and, given the ``owner`` (the
    process that started the world: ``pid``, ``started`` as psutil's ``create_time``, and the
    ``controller`` PID), watch it (:func:`watch_owner`). Returns the engine's PID. (The heavy
    modules, torch and mpu_lab.core.tensor_parallel, came with this module when the engine
    unpickled this function: before any collective timeout runs.)"""
    os.environ.update(env)
    if owner is not None:
        watch_owner(owner["pid"], owner["started"], owner["controller"])
    return os.getpid()


def engine_init(backend: str, timeout_s: float, tp: int, pp: int, port: Optional[int] = None):
    """(Re)initialise the default group and Megatron's groups; fill the cell namespace."""
    from IPython import get_ipython      # the engine's kernel (ipyparallel, an optional extra)

    if dist.is_initialized():    # a restart: the old group may be broken (timed out)
        with contextlib.suppress(Exception):
            parallel_state.destroy_model_parallel()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    info = initialize.init(backend=backend, timeout_s=timeout_s)
    parallel_state.initialize_model_parallel(tp, pp)
    dist.barrier()               # connect the pairs now, so the first cell is quick
    names = dict(torch=torch, dist=dist, np=np, mpu_lab=mpu_lab, comm=comm,
                 parallel_state=parallel_state,
                 tensor_parallel=tensor_parallel, rank=info.rank, world_size=info.world_size,
                 device=info.device)
    names.update({n: getattr(mappings, n) for n in dir(mappings)
                  if n.endswith("_region") and not n.startswith("_")})
    get_ipython().user_ns.update(names)
    return {"backend": info.backend, "device": str(info.device)}


def engine_values(expr: str):
    """``expr`` evaluated in the engine's namespace, a tensor turned into nested lists."""
    from IPython import get_ipython      # the engine's kernel (ipyparallel, an optional extra)
    return _as_values(eval(expr, get_ipython().user_ns))


def run_on_engine(what, args=(), kwargs=None, rank: int = 0) -> dict:
    """Run a function, or a code string in the engine's namespace (its last expression is the
    value, as in IPython), capturing stdout/stderr; never raise, so every rank reports."""
    out, err = io.StringIO(), io.StringIO()
    reply: Dict[str, Any] = {"value": None}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if callable(what):
                reply["value"] = what(*args, **(kwargs or {}))
            else:
                from IPython import get_ipython   # the engine's kernel (optional extra)
                namespace = get_ipython().user_ns
                filename = f"<rank {rank} cell>"
                linecache.cache[filename] = (len(what), None, what.splitlines(True), filename)
                tree = ast.parse(what, filename)
                last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
                exec(compile(tree, filename, "exec"), namespace)
                if last is not None:
                    expr = ast.Expression(last.value)
                    reply["value"] = eval(compile(expr, filename, "eval"), namespace)
        reply["value"] = _on_host(reply["value"])
    except BaseException as exc:    # noqa: BLE001 -- reported to the notebook, rank-labelled
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None   # drop this frame
        reply["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        reply["traceback"] = "".join(traceback.format_exception(type(exc), exc, tb))
        reply["timed_out"] = _waited_in_collective(exc)
    try:
        pickle.dumps(reply["value"])
    except Exception:                # an unpicklable value comes back as its repr
        reply["value"] = repr(reply["value"])
    reply["stdout"], reply["stderr"] = out.getvalue(), err.getvalue()
    return reply


def _on_host(value):
    """``value`` with every tensor in it (also in lists, tuples, dicts) on the CPU, so the
    notebook never unpickles a CUDA tensor (which would open a CUDA context on the GPU of the
    same index in the notebook's process) and prints the same repr as on a CPU machine. A CPU
    tensor is returned as it is; a GPU tensor as a detached CPU copy that keeps
    ``requires_grad``."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            return value
        host = value.detach().cpu()
        return host.requires_grad_() if value.requires_grad and host.is_floating_point() else host
    if type(value) in (list, tuple):     # exactly: torch.Size, named tuples stay as they are
        return type(value)(_on_host(v) for v in value)
    if type(value) is dict:
        return {k: _on_host(v) for k, v in value.items()}
    return value


def _as_values(value):
    """A tensor (any device, with or without grad) as nested lists of floats; lists, tuples
    and dicts of tensors likewise."""
    if isinstance(value, torch.Tensor):
        return value.detach().float().cpu().tolist()
    if type(value) in (list, tuple):
        return type(value)(_as_values(v) for v in value)
    if type(value) is dict:
        return {k: _as_values(v) for k, v in value.items()}
    return value
