"""A live multi-rank world for notebook cells: ipyparallel engines are the ranks.

    >>> from mpu_lab import playground                                    # doctest: +SKIP
    >>> world = playground.start_world(4, tensor_model_parallel_size=2)   # doctest: +SKIP
    >>> world.run("x = torch.tensor([float(rank)]); dist.all_reduce(x); x")   # doctest: +SKIP
    [tensor([6.]), tensor([6.]), tensor([6.]), tensor([6.])]
    >>> world.stop()                                                      # doctest: +SKIP

``launch.run`` starts a fresh ``torchrun`` job per call (the way the labs run whole programs);
a playground world stays up between cells, so a learner can poke the same process group cell
after cell. Each engine of an ipyparallel cluster is one rank: it gets torchrun's environment
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, a free ``MASTER_PORT``),
initialises ``torch.distributed`` by :func:`mpu_lab.distributed.init`'s rule (NCCL when each rank
has a GPU of its own, gloo otherwise) and Megatron's groups with
:func:`mpu_lab.parallel_state.initialize_model_parallel`.

* :meth:`World.run` runs a function or a code string on every rank (or on ``ranks=``) and
  returns the per-rank results in rank order; a rank that raises makes it raise
  :class:`RankError` with that rank's traceback, the world stays usable.
* ``%%ranks`` (``%load_ext mpu_lab.playground``; :func:`start_world` loads it too) runs a cell on
  every rank and prints each rank's output under a ``--- rank N ---`` heading, in rank order.
* A collective that only some ranks enter times out after ``timeout_s`` (short, for interactive
  use) and raises :class:`CollectiveTimeout` naming the ranks that did not arrive. gloo closes
  the pairs of a timed-out group, so the group is unusable: :meth:`World.restart` builds a new
  one (a new port, the same engines; new engines if they do not answer).
* :meth:`World.stop` ends every engine and the controller; the cluster is also stopped when
  the interpreter (the notebook kernel) exits.
"""
from __future__ import annotations

import atexit
import contextlib
import io
import os
import re
import signal
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

DEFAULT_TIMEOUT_S = 15.0      # collective timeout: a stuck cell answers in seconds, not minutes
START_TIMEOUT_S = 180.0       # engines registering with the controller on a busy machine
HEADING = "--- rank {} ---"
_TIMEOUT_TEXT = re.compile(r"timed out|timeout", re.I)
_WORLDS: List["World"] = []   # started and not stopped (stopped at exit)
_CURRENT: Optional["World"] = None   # the world %%ranks talks to


class PlaygroundError(RuntimeError):
    """The world cannot do what was asked (not started, stopped, needs a restart)."""


class RankError(PlaygroundError):
    """Some ranks raised. ``failures`` maps rank -> :class:`RankOutput`; ``outputs`` has every
    rank that ran, in rank order (the others' values and stdout included)."""

    def __init__(self, message: str, outputs: Sequence["RankOutput"]):
        super().__init__(message)
        self.outputs = list(outputs)
        self.failures = {o.rank: o for o in outputs if o.error}


class CollectiveTimeout(RankError):
    """A collective timed out on ``waiting`` because ``missing`` never entered it."""

    def __init__(self, message: str, outputs: Sequence["RankOutput"], waiting: List[int],
                 missing: List[int]):
        super().__init__(message, outputs)
        self.waiting = waiting
        self.missing = missing


class RankOutput:
    """What one rank's cell produced: ``value`` (the function's return value, or a code
    string's last expression), captured ``stdout``/``stderr``, and on failure ``error``
    (``"ZeroDivisionError: division by zero"``) with its ``traceback`` text."""

    def __init__(self, rank: int, value: Any = None, stdout: str = "", stderr: str = "",
                 error: str = "", traceback: str = "", timed_out: bool = False):
        self.rank, self.value, self.stdout, self.stderr = rank, value, stdout, stderr
        self.error, self.traceback, self.timed_out = error, traceback, timed_out

    def __repr__(self) -> str:
        state = f"error={self.error!r}" if self.error else f"value={self.value!r}"
        return f"RankOutput(rank={self.rank}, {state})"


# --------------------------------------------------------------------------- engine side
# These run inside the engines (pickled by reference: every engine imports mpu_lab).
def _engine_setup(env: Dict[str, str]) -> int:
    """Put torchrun's variables in this engine's environment; import the heavy modules now,
    outside any collective timeout. Returns the engine's PID."""
    os.environ.update(env)
    import torch  # noqa: F401
    import mpu_lab.tensor_parallel  # noqa: F401
    return os.getpid()


def _engine_init(backend: str, timeout_s: float, tp: int, pp: int, port: Optional[int] = None):
    """(Re)initialise the default group and Megatron's groups; fill the cell namespace."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from IPython import get_ipython

    import mpu_lab
    from mpu_lab import comm, distributed, parallel_state, tensor_parallel
    from mpu_lab.tensor_parallel import mappings

    if dist.is_initialized():    # a restart: the old group may be broken (timed out)
        with contextlib.suppress(Exception):
            parallel_state.destroy_model_parallel()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    info = distributed.init(backend=backend, timeout_s=timeout_s)
    parallel_state.initialize_model_parallel(tp, pp)
    dist.barrier()               # connect the pairs now, so the first cell is quick
    names = dict(torch=torch, dist=dist, np=np, mpu_lab=mpu_lab, comm=comm,
                 distributed=distributed, parallel_state=parallel_state,
                 tensor_parallel=tensor_parallel, rank=info.rank, world_size=info.world_size,
                 device=info.device)
    names.update({n: getattr(mappings, n) for n in dir(mappings)
                  if n.endswith("_region") and not n.startswith("_")})
    get_ipython().user_ns.update(names)
    return {"backend": info.backend, "device": str(info.device)}


def _engine_values(expr: str):
    """``expr`` evaluated in the engine's namespace, a tensor turned into nested lists."""
    from IPython import get_ipython
    return _as_values(eval(expr, get_ipython().user_ns))


def _run_on_engine(what, args=(), kwargs=None, rank: int = 0) -> dict:
    """Run a function, or a code string in the engine's namespace (its last expression is the
    value, as in IPython), capturing stdout/stderr; never raise, so every rank reports."""
    import ast
    import linecache
    import pickle

    out, err = io.StringIO(), io.StringIO()
    reply: Dict[str, Any] = {"value": None}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if callable(what):
                reply["value"] = what(*args, **(kwargs or {}))
            else:
                from IPython import get_ipython
                namespace = get_ipython().user_ns
                filename = f"<rank {rank} cell>"
                linecache.cache[filename] = (len(what), None, what.splitlines(True), filename)
                tree = ast.parse(what, filename)
                last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
                exec(compile(tree, filename, "exec"), namespace)
                if last is not None:
                    expr = ast.Expression(last.value)
                    reply["value"] = eval(compile(expr, filename, "eval"), namespace)
    except BaseException as exc:    # noqa: BLE001 -- reported to the notebook, rank-labelled
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None   # drop this frame
        reply["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        reply["traceback"] = "".join(traceback.format_exception(type(exc), exc, tb))
        # gloo and NCCL report a timed-out collective as a RuntimeError (DistBackendError)
        reply["timed_out"] = isinstance(exc, RuntimeError) and bool(_TIMEOUT_TEXT.search(str(exc)))
    try:
        pickle.dumps(reply["value"])
    except Exception:                # an unpicklable value comes back as its repr
        reply["value"] = repr(reply["value"])
    reply["stdout"], reply["stderr"] = out.getvalue(), err.getvalue()
    return reply


# --------------------------------------------------------------------------- controller side
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_world_args(world_size, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                     backend="auto", timeout_s=DEFAULT_TIMEOUT_S) -> None:
    """Raise ``ValueError`` naming the numbers before any process starts."""
    from mpu_lab import launch, parallel_state
    parallel_state.check_sizes(world_size, tensor_model_parallel_size,
                               pipeline_model_parallel_size)
    limit = launch.max_ranks()
    if world_size > limit:
        raise ValueError(f"world_size {world_size} is more ranks than this machine starts "
                         f"({limit}, launch.max_ranks(); MPU_LAB_MAX_RANKS overrides)")
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and world_size > _gpu_count():
        raise ValueError(f"backend 'nccl' needs one GPU per rank: world_size {world_size} but "
                         f"{_gpu_count()} GPU(s) visible; use 'auto' or 'gloo'")
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")


class World:
    """A running playground world; made by :func:`start_world`."""

    def __init__(self, world_size: int, tensor_model_parallel_size: int = 1,
                 pipeline_model_parallel_size: int = 1, backend: str = "auto",
                 timeout_s: float = DEFAULT_TIMEOUT_S, start_timeout_s: float = START_TIMEOUT_S):
        check_world_args(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                         backend, timeout_s)
        self.world_size = world_size
        self.tp, self.pp = tensor_model_parallel_size, pipeline_model_parallel_size
        self.requested_backend, self.timeout_s = backend, float(timeout_s)
        self.start_timeout_s = start_timeout_s
        self.cluster = self.client = None
        self.engine_ids: List[int] = []
        self.pids: List[int] = []
        self.controller_pid: Optional[int] = None
        self.backend = self.device = None
        self.broken = ""            # why the group is unusable ("" when fine)
        self.timings: Dict[str, float] = {}

    # -- life cycle
    def _start_engines(self) -> None:
        import ipyparallel as ipp
        threads = max(1, (os.cpu_count() or 1) // self.world_size)
        from mpu_lab import launch   # engines import mpu_lab from this checkout, like torchrun jobs
        path = os.pathsep.join(p for p in (str(launch.REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        t0 = time.perf_counter()
        self.cluster = ipp.Cluster(n=self.world_size, log_level=40, shutdown_atexit=True)
        _WORLDS.append(self)
        self.cluster.start_controller_sync()
        # ipyparallel registered its own exit handler just now; run ours first (atexit is
        # last-in first-out), while the engines' nannies are still findable as descendants.
        atexit.unregister(_stop_all)
        atexit.register(_stop_all)
        self.cluster.start_engines_sync(self.world_size, environment=env)
        self.client = self.cluster.connect_client_sync()
        self.client.wait_for_engines(self.world_size, timeout=self.start_timeout_s,
                                     interactive=False)   # no progress bar in the notebook
        self.timings["engines_registered_s"] = time.perf_counter() - t0
        self.controller_pid = self.cluster.controller.process.pid
        self.engine_ids = sorted(self.client.ids)[: self.world_size]
        port = _free_port()
        replies = [self.client[e].apply_async(_engine_setup, {
            "RANK": str(r), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": str(self.world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "MPU_LAB_TIMEOUT_S": str(self.timeout_s)})
            for r, e in enumerate(self.engine_ids)]
        self.pids = [a.get(timeout=self.start_timeout_s) for a in replies]
        self.timings["engine_start_s"] = time.perf_counter() - t0

    def _init_group(self, new_port: bool = False) -> None:
        t0 = time.perf_counter()
        port = _free_port() if new_port else None
        replies = [self.client[e].apply_async(_engine_init, self.requested_backend,
                                              self.timeout_s, self.tp, self.pp, port)
                   for e in self.engine_ids]
        infos = [a.get(timeout=self.start_timeout_s + self.timeout_s) for a in replies]
        self.backend, self.device = infos[0]["backend"], [i["device"] for i in infos]
        self.broken = ""
        self.timings["group_init_s"] = time.perf_counter() - t0

    def start(self) -> "World":
        """Start the engines and the groups; this world becomes the one ``%%ranks`` uses."""
        global _CURRENT
        try:
            self._start_engines()
            self._init_group()
        except BaseException:
            self.stop()
            raise
        _CURRENT = self
        return self

    def stop(self) -> None:
        """End every engine and the controller (idempotent)."""
        global _CURRENT
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        # SIGTERM the whole process tree at once (engines, their nannies, the controller and
        # its schedulers; ipyparallel's own stop waits on each engine in turn), SIGKILL what
        # outlives a second (an engine takes ~1.6 s to exit cleanly, its nanny ~2 s more, and
        # neither holds anything worth keeping), then let the cluster remove its files.
        _kill_leftovers(self.process_tree(), grace_s=1.0)
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.stop_cluster_sync()
        self.cluster = self.client = None
        if self in _WORLDS:
            _WORLDS.remove(self)
        if _CURRENT is self:
            _CURRENT = None

    def process_tree(self) -> List[int]:
        """PIDs of the engines, the controller and all their descendants (nannies, schedulers)."""
        import psutil
        roots = self.pids + ([self.controller_pid] if self.controller_pid else [])
        if self.cluster is not None:    # also engines that never reported their PID
            with contextlib.suppress(Exception):
                roots += [launcher.pid for engine_set in self.cluster.engines.values()
                          for launcher in engine_set.launchers.values()]
                roots.append(self.cluster.controller.process.pid)
        found = list(dict.fromkeys(p for p in roots if p))
        for pid in roots:
            with contextlib.suppress(psutil.Error):
                found += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        return list(dict.fromkeys(found))

    @property
    def running(self) -> bool:
        return self.client is not None

    def restart(self, hard: bool = False) -> "World":
        """Make the world usable again after a timeout or a stuck rank, in one call.

        Soft (default): every engine destroys its process group and joins a new one on a new
        port (about a second); Python state in the engines is kept. If an engine does not
        answer (still stuck in a cell), or with ``hard=True``, the engines are replaced.
        """
        if self.running and not hard and all(not q for q in self._queues()):
            try:
                self._init_group(new_port=True)
                return self
            except Exception:      # noqa: BLE001 -- fall back to fresh engines
                pass
        self.stop()
        return self.start()

    def _queues(self) -> List[int]:
        status = self.client.queue_status(targets=self.engine_ids)
        return [status[e]["queue"] + status[e].get("tasks", 0) for e in self.engine_ids]

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        if self.broken:
            state = "needs restart()"
        return (f"World(world_size={self.world_size}, tp={self.tp}, pp={self.pp}, "
                f"backend={self.backend!r}, {state})")

    # -- running cells
    def _ranks(self, ranks: Optional[Sequence[int]]) -> List[int]:
        if ranks is None:
            return list(range(self.world_size))
        chosen = sorted({int(r) for r in ranks})
        bad = [r for r in chosen if not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"ranks {bad} are not in this world (ranks 0..{self.world_size - 1})")
        return chosen

    def execute(self, fn_or_code: Union[str, Callable], *args, ranks=None,
                **kwargs) -> List[RankOutput]:
        """Run on ``ranks`` (default: all) and return each rank's :class:`RankOutput`, rank
        order, without raising for a failing rank (see :meth:`run`)."""
        if not self.running:
            raise PlaygroundError("this world is stopped: start a new one with start_world(...)")
        if self.broken:
            raise PlaygroundError(f"{self.broken}; call world.restart() first")
        chosen = self._ranks(ranks)
        if isinstance(fn_or_code, str):
            args, kwargs = (), {}
        replies = [self.client[self.engine_ids[r]].apply_async(
            _run_on_engine, fn_or_code, args, kwargs, r) for r in chosen]
        try:
            got = [a.get() for a in replies]
        except KeyboardInterrupt:
            with contextlib.suppress(Exception):
                self.cluster.signal_engines_sync(signal.SIGINT)
            self.broken = "a cell was interrupted while the ranks ran it"
            raise
        outputs = [RankOutput(r, g["value"], g["stdout"], g["stderr"], g.get("error", ""),
                              g.get("traceback", ""), g.get("timed_out", False))
                   for r, g in zip(chosen, got)]
        waiting = [o.rank for o in outputs if o.timed_out]
        if waiting:
            self.broken = (f"a collective timed out on ranks {waiting}, and gloo/NCCL closes a "
                           f"timed-out group")
        return outputs

    def run(self, fn_or_code: Union[str, Callable], *args, ranks=None, **kwargs) -> List[Any]:
        """Run a function (``fn(*args, **kwargs)``) or a code string on every rank (or on
        ``ranks``) and return the values in rank order (one per rank run).

        A code string runs in the engine's namespace, which holds ``torch``, ``dist``, ``np``,
        the :mod:`mpu_lab` modules, the tensor-parallel ``*_region`` functions, ``rank``,
        ``world_size`` and ``device``; its value is its last expression. Raises
        :class:`RankError` (every failing rank's traceback) or :class:`CollectiveTimeout`.
        """
        outputs = self.execute(fn_or_code, *args, ranks=ranks, **kwargs)
        _raise_for(outputs, self)
        return [o.value for o in outputs]

    def show(self, fn_or_code: Union[str, Callable], *args, ranks=None, **kwargs) -> None:
        """Run like :meth:`run` and print each rank's stdout (and value, or traceback) under a
        ``--- rank N ---`` heading, in rank order; stderr goes to stderr. What ``%%ranks`` does."""
        import sys
        try:
            outputs = self.execute(fn_or_code, *args, ranks=ranks, **kwargs)
        except PlaygroundError as exc:
            print(f"playground: {exc}")
            return
        for o in outputs:
            print(HEADING.format(o.rank) + (f" raised {o.error.splitlines()[0]}" if o.error else ""))
            if o.stdout:
                print(o.stdout, end="" if o.stdout.endswith("\n") else "\n")
            if o.error:
                print(o.traceback, end="")
            elif o.value is not None:
                print(repr(o.value))
            if o.stderr:
                print(f"rank {o.rank} (stderr): {o.stderr}", end="", file=sys.stderr)
        problem = _problem(outputs, self)
        if problem:
            print(problem)

    # -- pictures
    def values(self, expr: str, ranks=None) -> List[Any]:
        """``expr`` evaluated on each rank, tensors as (nested) lists of floats: for pictures."""
        return self.run(_engine_values, expr, ranks=ranks)   # lists: the notebook needs no torch

    def groups(self, family: str = "tp") -> List[List[int]]:
        """The rank lists of one group family of this world (``"tp"``, ``"dp"``, ``"pp"``...)."""
        from mpu_lab import parallel_state
        return parallel_state.generate_rank_groups(self.world_size, self.tp, self.pp)[family]

    def picture(self, title: str, before: str, after: str, family: str = "tp"):
        """Each rank's ``before`` and ``after`` (names or expressions on the ranks) side by side,
        one column per rank, the ``family`` groups marked: :func:`mpu_lab.viz.plot_collective`."""
        from mpu_lab import viz
        return viz.plot_collective(title, self.values(before), self.values(after),
                                   groups=self.groups(family))


def _as_values(value):
    """A tensor (any device, with or without grad) as nested lists of floats."""
    if hasattr(value, "detach"):
        return value.detach().float().cpu().tolist()
    return value


def _problem(outputs: Sequence[RankOutput], world: World) -> str:
    """One message for what went wrong, '' if nothing did."""
    failed = [o.rank for o in outputs if o.error]
    if not failed:
        return ""
    waiting = [o.rank for o in outputs if o.timed_out]
    if waiting:
        ran = {o.rank for o in outputs}
        not_run = [r for r in range(world.world_size) if r not in ran]
        done = [o.rank for o in outputs if not o.error]
        raised = [r for r in failed if r not in waiting]
        missing = sorted(set(range(world.world_size)) - set(waiting))
        why = []
        if not_run:
            why.append(f"ranks {not_run} were not asked to run this cell")
        if done:
            why.append(f"ranks {done} finished it without entering the collective")
        if raised:
            why.append(f"ranks {raised} raised before reaching it")
        return (f"collective timed out after {world.timeout_s:g} s on ranks {waiting}: ranks "
                f"{missing} did not arrive ({'; '.join(why)}). The process group is unusable "
                f"now: call world.restart().")
    return f"ranks {failed} raised (tracebacks above, rank-labelled); the world is still usable."


def _raise_for(outputs: Sequence[RankOutput], world: World) -> None:
    problem = _problem(outputs, world)
    if not problem:
        return
    failed = [o for o in outputs if o.error]
    details = "\n".join(f"{HEADING.format(o.rank)}\n{o.traceback}" for o in failed)
    waiting = [o.rank for o in outputs if o.timed_out]
    if waiting:
        missing = sorted(set(range(world.world_size)) - set(waiting))
        raise CollectiveTimeout(f"{problem}\n{details}", outputs, waiting, missing)
    raise RankError(f"{problem}\n{details}", outputs)


def _kill_leftovers(pids: Sequence[int], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, whatever of ``pids`` outlived the cluster's own shutdown."""
    import psutil
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def start_world(world_size: int, tensor_model_parallel_size: int = 1,
                pipeline_model_parallel_size: int = 1, backend: str = "auto",
                timeout_s: float = DEFAULT_TIMEOUT_S,
                start_timeout_s: float = START_TIMEOUT_S) -> World:
    """Start ``world_size`` engines as the ranks of one ``torch.distributed`` world with
    Megatron's groups for ``tensor_model_parallel_size`` x ``pipeline_model_parallel_size``.

    ``timeout_s`` is the collective timeout. The arguments are checked (``ValueError``) before
    anything starts. In IPython the ``%%ranks`` magic is loaded and talks to this world.
    """
    world = World(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                  backend, timeout_s, start_timeout_s).start()
    with contextlib.suppress(Exception):
        from IPython import get_ipython
        shell = get_ipython()
        if shell is not None:
            load_ipython_extension(shell)
    return world


def current_world() -> World:
    """The world ``%%ranks`` runs on: the last one :func:`start_world` started."""
    if _CURRENT is None or not _CURRENT.running:
        raise PlaygroundError("no playground world is running: world = playground.start_world(4)")
    return _CURRENT


def _stop_all() -> None:
    for world in list(_WORLDS):
        world.stop()


# --------------------------------------------------------------------------- %%ranks
def ranks_magic(line: str, cell: str) -> None:
    """``%%ranks`` runs the cell on every rank; ``%%ranks 0 1`` (or ``0,1``) on some ranks."""
    try:
        chosen = [int(t) for t in line.replace(",", " ").split()] or None
        world = current_world()
        world._ranks(chosen)
    except (PlaygroundError, ValueError) as exc:
        print(f"playground: {exc} (usage: %%ranks, or %%ranks 0 2 for some ranks)")
        return
    world.show(cell, ranks=chosen)


def load_ipython_extension(shell) -> None:
    """``%load_ext mpu_lab.playground``: register ``%%ranks``."""
    shell.register_magic_function(ranks_magic, magic_kind="cell", magic_name="ranks")
