"""The notebook front end: :func:`start_world`, and the ``%%ranks`` cell magic that runs a cell
on every rank of the current world (``%load_ext mpu_lab.labkit.playground``; :func:`start_world`
loads it too)."""
from __future__ import annotations

import contextlib

from mpu_lab.labkit.playground.errors import PlaygroundError, RankError, world_problem
from mpu_lab.labkit.playground.world import DEFAULT_TIMEOUT_S, START_TIMEOUT_S, World, current_world


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


MAY_FAIL = "--may-fail"
USAGE = f"usage: %%ranks, %%ranks 0 2 for some ranks, %%ranks {MAY_FAIL} for a cell that shows an error"


def ranks_magic(line: str, cell: str) -> None:
    """``%%ranks`` runs the cell on every rank; ``%%ranks 0 1`` (or ``0,1``) on some ranks.

    Each rank's output is printed under its heading, in rank order. If a rank raised (or a
    collective timed out), the cell then fails with :class:`RankError`, so Run All and papermill
    stop at this cell, with the failing rank's traceback, not one cell later. ``%%ranks
    --may-fail`` prints the same and carries on: for cells that demonstrate an error.
    """
    tokens = line.replace(",", " ").split()
    may_fail = MAY_FAIL in tokens
    tokens = [t for t in tokens if t != MAY_FAIL]
    try:
        bad = [t for t in tokens if not t.lstrip("-").isdigit()]
        if bad:
            raise ValueError(f"{bad} are not rank numbers")
        chosen = [int(t) for t in tokens] or None
        world = current_world()
        world._ranks(chosen)
    except (PlaygroundError, ValueError) as exc:
        raise PlaygroundError(f"{exc} ({USAGE})") from None
    outputs = world.show(cell, ranks=chosen)
    problem = world_problem(outputs, world) if outputs is not None else ""
    if problem and not may_fail:
        # the tracebacks are printed above, under their ranks' headings
        raise RankError(f"{problem} (each rank's traceback is printed above; "
                        f"'%%ranks {MAY_FAIL}' shows an error and carries on)", outputs)


def load_ipython_extension(shell) -> None:
    """``%load_ext mpu_lab.labkit.playground``: register ``%%ranks``."""
    shell.register_magic_function(ranks_magic, magic_kind="cell", magic_name="ranks")
