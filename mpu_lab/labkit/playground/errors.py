"""What a playground world reports back: each rank's :class:`RankOutput`, and the errors a cell
raises when some ranks fail (:class:`RankError`) or a collective times out
(:class:`CollectiveTimeout`), with one message that says which ranks did what."""
from __future__ import annotations

from typing import Any, List, Sequence

HEADING = "--- rank {} ---"


class PlaygroundError(RuntimeError):
    """The world cannot do what was asked (not started, stopped, needs a restart)."""


class WorldStartTimeout(PlaygroundError):
    """The engines of a world being started did not all register, or did not all answer their
    first request, within ``start_timeout_s``; ``late`` names the ranks that did not answer
    (every rank while registering)."""

    def __init__(self, message: str, late: Sequence[int]):
        super().__init__(message)
        self.late = list(late)


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


def world_problem(outputs: Sequence[RankOutput], world: "World") -> str:
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


def raise_for_outputs(outputs: Sequence[RankOutput], world: "World") -> None:
    problem = world_problem(outputs, world)
    if not problem:
        return
    failed = [o for o in outputs if o.error]
    details = "\n".join(f"{HEADING.format(o.rank)}\n{o.traceback}" for o in failed)
    waiting = [o.rank for o in outputs if o.timed_out]
    if waiting:
        missing = sorted(set(range(world.world_size)) - set(waiting))
        raise CollectiveTimeout(f"{problem}\n{details}", outputs, waiting, missing)
    raise RankError(f"{problem}\n{details}", outputs)

