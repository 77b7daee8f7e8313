"""A running playground world (:class:`World`): ipyparallel engines as the ranks of one
``torch.distributed`` world, seen from the notebook (the controller side), and the registry of
started worlds (:func:`current_world`; all are stopped when the interpreter exits)."""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import psutil
import torch

from mpu_lab.training import initialize
from mpu_lab import launcher
from mpu_lab.core import parallel_state
from mpu_lab.labkit.playground.cluster_logs import quiet_about_removed_logs
from mpu_lab.labkit.playground.engine import (engine_env, engine_init, engine_setup, engine_values,
                                              run_on_engine)
from mpu_lab.labkit.playground.errors import (
    HEADING,
    PlaygroundError,
    RankOutput,
    WorldStartTimeout,
    world_problem,
    raise_for_outputs,
)
from mpu_lab.labkit.tp_mappings.viz import plot_collective
from mpu_lab.launcher import process_tree, runner

DEFAULT_TIMEOUT_S = 15.0      # collective timeout: a stuck cell answers in seconds, not minutes
START_TIMEOUT_S = 180.0       # engines registering with the controller on a busy machine
START_ATTEMPTS = 2            # a start that times out (or whose group fails on a connection)
                              # is made again once, from fresh engines
SETUP_RESEND_S = 10.0         # an engine's first request unanswered this long is sent again
RESTART_PORTS = 3             # new ports a soft restart tries before it replaces the engines
BUSY_SETTLE_S = 2.0           # how long restart() waits for the hub to see a finished cell
# ipyparallel's hub counts an engine registered once its heart beats: at the default period
# (3 s) a world of 2 took about 6 s to come up, mostly waiting; at 0.5 s about 2 s. The hub
# still gives an engine up after the default's 30 s without a beat (its heart is a zmq thread
# that answers while the engine computes).
HEARTBEAT_MS = 500
HEARTBEAT_MISSES = 30_000 // HEARTBEAT_MS
_WORLDS: List["World"] = []   # started and not stopped (stopped at exit)
_CURRENT: Optional["World"] = None   # the world %%ranks talks to

# The store's side of a group that failed on a connection (the port taken before rank 0 bound
# it); gloo's side is the launcher's ranks_could_not_connect. An engine's error comes back as
# ipyparallel's RemoteError, its ``ename`` the rank's exception class.
_STORE_CONNECTION_ERRORS = ("DistNetworkError", "Address already in use")


def connection_failed(exc: BaseException) -> bool:
    """Whether an engine's error says its process group failed on a connection."""
    text = f"{getattr(exc, 'ename', type(exc).__name__)} {exc}"
    return runner.ranks_could_not_connect(exc) or any(e in text for e in _STORE_CONNECTION_ERRORS)


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_world_args(world_size, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                     backend="auto", timeout_s=DEFAULT_TIMEOUT_S,
                     start_timeout_s=START_TIMEOUT_S) -> None:
    """Raise ``ValueError`` naming the numbers before any process starts."""
    parallel_state.check_sizes(world_size, tensor_model_parallel_size,
                               pipeline_model_parallel_size)
    limit = launcher.max_ranks()
    if world_size > limit:
        raise ValueError(f"world_size {world_size} is more ranks than this machine starts "
                         f"({limit}, launcher.max_ranks(); MPU_LAB_MAX_RANKS overrides)")
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and world_size > _gpu_count():
        raise ValueError(f"backend 'nccl' needs one GPU per rank: world_size {world_size} but "
                         f"{_gpu_count()} GPU(s) visible; use 'auto' or 'gloo'")
    for name, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")


class World:
    """A running playground world; made by :func:`start_world`."""

    def __init__(self, world_size: int, tensor_model_parallel_size: int = 1,
                 pipeline_model_parallel_size: int = 1, backend: str = "auto",
                 timeout_s: float = DEFAULT_TIMEOUT_S, start_timeout_s: float = START_TIMEOUT_S):
        check_world_args(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                         backend, timeout_s, start_timeout_s)
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
        self.restart_errors: List[str] = []   # why the last restart's new ports failed
        self.timings: Dict[str, float] = {}

    # -- life cycle
    def _start_engines(self) -> None:
        import ipyparallel as ipp    # optional (the labs extra): only when a world starts
        threads = max(1, (os.cpu_count() or 1) // self.world_size)
        # engines import mpu_lab from this checkout, like torchrun jobs
        path = launcher.job_pythonpath(os.environ.get("PYTHONPATH"))
        env = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        t0 = time.perf_counter()
        # cluster_file="": the cluster is never written to the profile's security folder.
        # JupyterLab's ipyparallel extension loads every cluster file it finds there and
        # watches its processes; when this kernel stops them, the extension saw engines end
        # with no exit code and logged each engine's whole log (SIGTERM's "Event loop stopped
        # before Future completed") as a warning in the server's terminal, then raced this
        # kernel to delete the log files. A cluster it never sees, it never reports.
        self.cluster = ipp.Cluster(n=self.world_size, log_level=40, shutdown_atexit=True,
                                   cluster_file="", controller_args=[
                                       f"--HeartMonitor.period={HEARTBEAT_MS}",
                                       f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}"])
        quiet_about_removed_logs(self.cluster.log)
        _WORLDS.append(self)
        self.cluster.start_controller_sync()
        # ipyparallel registered its own exit handler just now; run ours first (atexit is
        # last-in first-out), while the engines' nannies are still findable as descendants.
        atexit.unregister(_stop_all)
        atexit.register(_stop_all)
        self.cluster.start_engines_sync(self.world_size, environment=env)
        self.client = self.cluster.connect_client_sync()
        try:
            self.client.wait_for_engines(self.world_size, timeout=self.start_timeout_s,
                                         interactive=False)   # no progress bar in the notebook
        except TimeoutError as exc:
            raise WorldStartTimeout(f"only {len(self.client.ids)} of {self.world_size} "
                                    f"engines registered within {self.start_timeout_s:g} s",
                                    range(self.world_size)) from exc
        self.timings["engines_registered_s"] = time.perf_counter() - t0
        self.controller_pid = self.cluster.controller.process.pid
        self.engine_ids = sorted(self.client.ids)[: self.world_size]
        port = initialize.free_port()
        # ipyparallel tells the client an engine registered before the engine has surely
        # connected to the scheduler, and a request routed to it before then is dropped
        # (ipyparallel issue #476). The setup request is idempotent, so a rank that has not
        # answered it is asked again every SETUP_RESEND_S; the first answer counts. Once every
        # engine has answered, each is connected, and later requests are sent once.
        envs = [engine_env(r, self.world_size, port, self.timeout_s)
                for r in range(self.world_size)]
        owner = {"pid": os.getpid(), "started": psutil.Process().create_time(),
                 "controller": self.controller_pid}
        self.pids = self._answers(
            lambda r: self.client[self.engine_ids[r]].apply_async(engine_setup, envs[r], owner),
            self.start_timeout_s, "set up", resend_s=SETUP_RESEND_S)
        self.timings["engine_start_s"] = time.perf_counter() - t0

    def _init_group(self, new_port: bool = False) -> None:
        t0 = time.perf_counter()
        port = initialize.free_port() if new_port else None
        infos = self._answers(
            lambda r: self.client[self.engine_ids[r]].apply_async(
                engine_init, self.requested_backend, self.timeout_s, self.tp, self.pp, port),
            self.start_timeout_s + self.timeout_s, "join the process group")
        self.backend, self.device = infos[0]["backend"], [i["device"] for i in infos]
        self.broken = ""
        self.timings["group_init_s"] = time.perf_counter() - t0

    def _answers(self, send: Callable[[int], Any], timeout_s: float, what: str,
                 resend_s: Optional[float] = None) -> List[Any]:
        """Every rank's answer to ``send(rank)`` (an ipyparallel AsyncResult), in rank order.
        With ``resend_s``, a rank still silent after that long is sent the request again (the
        first answer counts). :class:`WorldStartTimeout` names the ranks that did not answer
        within ``timeout_s``, one deadline for all."""
        deadline = time.monotonic() + timeout_s
        sent = {r: [send(r)] for r in range(self.world_size)}
        last_sent = time.monotonic()
        while True:
            first = {r: next((a for a in tries if a.ready()), None) for r, tries in sent.items()}
            late = [r for r, a in first.items() if a is None]
            if not late:
                return [first[r].get() for r in range(self.world_size)]
            now = time.monotonic()
            if now >= deadline:
                raise WorldStartTimeout(f"rank(s) {late} did not {what} within {timeout_s:g} s "
                                        f"(the engines had registered)", late)
            if resend_s is not None and now - last_sent >= resend_s:
                for r in late:
                    sent[r].append(send(r))
                last_sent = now
            time.sleep(0.02)

    def start(self) -> "World":
        """Start the engines and the groups; this world becomes the one ``%%ranks`` uses.

        On a loaded machine an engine now and then registers and then never answers its first
        request (seen once in CI, beside the other test worker's jobs). A start that times out
        is stopped and made again from fresh engines, up to ``START_ATTEMPTS`` starts in all
        (``timings["start_attempts"]`` counts them); then :class:`WorldStartTimeout` says what
        did not answer. So is a start whose process group failed on a connection (gloo's or
        the store's: the free port chosen was taken by another process before rank 0 bound it,
        or a peer closed a connection on the loaded machine). Any other error stops the world
        and is raised at once."""
        global _CURRENT
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._start_engines()
                self._init_group()
                break
            except Exception as exc:
                self.stop()
                timed_out = isinstance(exc, WorldStartTimeout)
                if not (timed_out or connection_failed(exc)):
                    raise
                if attempt < START_ATTEMPTS:
                    continue
                if not timed_out:
                    raise
                raise WorldStartTimeout(
                    f"the world's engines did not start: {exc} (tried {attempt} times, "
                    f"from fresh engines each time). On a busy machine give them longer, "
                    f"start_world(..., start_timeout_s={2 * self.start_timeout_s:g}), or "
                    f"end other jobs first.", exc.late) from exc
            except BaseException:
                self.stop()
                raise
        self.timings["start_attempts"] = attempt
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
        process_tree.stop(process_tree.processes(self.process_tree()), grace_s=1.0)
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
        roots = self.pids + ([self.controller_pid] if self.controller_pid else [])
        if self.cluster is not None:    # also engines that never reported their PID
            with contextlib.suppress(Exception):
                roots += [launcher.pid for engine_set in self.cluster.engines.values()
                          for launcher in engine_set.launchers.values()]
                roots.append(self.cluster.controller.process.pid)
        found = list(dict.fromkeys(p for p in roots if p))
        for pid in roots:
            found += [p.pid for p in process_tree.tree(pid)[1:]]
        return list(dict.fromkeys(found))

    @property
    def running(self) -> bool:
        return self.client is not None

    def restart(self, hard: bool = False) -> "World":
        """Make the world usable again after a timeout or a stuck rank, in one call.

        Soft (default): every engine destroys its process group and joins a new one on a new
        port (about a second); Python state in the engines is kept. Up to ``RESTART_PORTS``
        new ports are tried (gloo now and then loses a connection, or misses its timeout,
        while a loaded machine sets up the new group); ``restart_errors`` keeps why each
        failed. If an engine does not answer (still stuck in a cell), or with ``hard=True``,
        the engines are replaced.
        """
        self.restart_errors = []
        for _ in range(RESTART_PORTS):
            if not self.running or hard or self._busy():
                break
            try:
                self._init_group(new_port=True)
                return self
            except Exception as exc:      # noqa: BLE001 -- a new port, then fresh engines
                self.restart_errors.append(f"{type(exc).__name__}: {exc}"[:500])
        self.stop()
        return self.start()

    def _queues(self) -> List[int]:
        status = self.client.queue_status(targets=self.engine_ids)
        return [status[e]["queue"] + status[e].get("tasks", 0) for e in self.engine_ids]

    def _busy(self, settle_s: float = BUSY_SETTLE_S) -> bool:
        """Whether an engine still has work queued, asked again for up to ``settle_s``: the
        hub learns that a task ended a moment after the client has its result, so on a loaded
        machine a cell that has just finished can still count as queued (a full run once
        replaced the engines of a soft restart that way)."""
        deadline = time.monotonic() + settle_s
        while any(self._queues()):
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.1)
        return False

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
            run_on_engine, fn_or_code, args, kwargs, r) for r in chosen]
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
        ``world_size`` and ``device`` (the rank's device: make tensors with ``device=device``,
        NCCL ranks refuse CPU tensors); its value is its last expression, tensors in it moved
        to the CPU. Raises
        :class:`RankError` (every failing rank's traceback) or :class:`CollectiveTimeout`.
        """
        outputs = self.execute(fn_or_code, *args, ranks=ranks, **kwargs)
        raise_for_outputs(outputs, self)
        return [o.value for o in outputs]

    def show(self, fn_or_code: Union[str, Callable], *args, ranks=None,
             **kwargs) -> Optional[List[RankOutput]]:
        """Run like :meth:`run` and print each rank's stdout (and value, or traceback) under a
        ``--- rank N ---`` heading, in rank order; stderr goes to stderr. What ``%%ranks`` does.
        Returns the ranks' outputs (``None`` when the world could not run the cell: the reason
        is printed); it does not raise for a failing rank."""
        try:
            outputs = self.execute(fn_or_code, *args, ranks=ranks, **kwargs)
        except PlaygroundError as exc:
            print(f"playground: {exc}")
            return None
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
        problem = world_problem(outputs, self)
        if problem:
            print(problem)
        return outputs

    # -- pictures
    def values(self, expr: str, ranks=None) -> List[Any]:
        """``expr`` evaluated on each rank, tensors as (nested) lists of floats: for pictures."""
        return self.run(engine_values, expr, ranks=ranks)   # lists: the notebook needs no torch

    def groups(self, family: str = "tp") -> List[List[int]]:
        """The rank lists of one group family of this world (``"tp"``, ``"dp"``, ``"pp"``...)."""
        return parallel_state.generate_rank_groups(self.world_size, self.tp, self.pp)[family]

    def picture(self, title: str, before: str, after: str, family: str = "tp"):
        """Each rank's ``before`` and ``after`` (names or expressions on the ranks) side by side,
        one column per rank, the ``family`` groups marked
        (:func:`mpu_lab.labkit.tp_mappings.viz.plot_collective`)."""
        return plot_collective(title, self.values(before), self.values(after),
                                   groups=self.groups(family))


def current_world() -> World:
    """The world ``%%ranks`` runs on: the last one :func:`start_world` started."""
    if _CURRENT is None or not _CURRENT.running:
        raise PlaygroundError("no playground world is running: world = playground.start_world(4)")
    return _CURRENT


def _stop_all() -> None:
    for world in list(_WORLDS):
        world.stop()

