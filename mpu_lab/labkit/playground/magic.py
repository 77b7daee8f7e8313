"""The notebook front end: :func:`start_world`, and the ``%%ranks`` cell magic that runs a cell
on every rank of the current world (``%load_ext mpu_lab.labkit.playground``; :func:`start_world`
loads it too)."""
from __future__ import annotations

import contextlib

from mpu_lab.labkit.playground.errors import PlaygroundError
from mpu_lab.labkit.playground.world import (
    DEFAULT_TIMEOUT_S,
    START_TIMEOUT_S,
    World,
    current_world,
)


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
    """``%load_ext mpu_lab.labkit.playground``: register ``%%ranks``."""
    shell.register_magic_function(ranks_magic, magic_kind="cell", magic_name="ranks")
