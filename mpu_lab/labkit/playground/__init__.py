"""A live multi-rank world for notebook cells: ipyparallel engines are the ranks.

    >>> from mpu_lab.labkit import playground                             # doctest: +SKIP
    >>> world = playground.start_world(4, tensor_model_parallel_size=2)   # doctest: +SKIP
    >>> world.run("x = torch.tensor([float(rank)], device=device); dist.all_reduce(x); x")  # doctest: +SKIP
    [tensor([6.]), tensor([6.]), tensor([6.]), tensor([6.])]
    >>> world.stop()                                                      # doctest: +SKIP

``launcher.run`` starts a fresh ``torchrun`` job per call (the way the labs run whole programs);
a playground world stays up between cells, so a learner can poke the same process group cell
after cell. Each engine of an ipyparallel cluster is one rank: it gets torchrun's environment
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, a free ``MASTER_PORT``),
initialises ``torch.distributed`` by :func:`mpu_lab.training.initialize.init`'s rule (NCCL when each rank
has a GPU of its own, gloo otherwise) and Megatron's groups with
:func:`mpu_lab.core.parallel_state.initialize_model_parallel`. A cell finds its rank's device in
``device`` (``cuda:LOCAL_RANK`` on NCCL, a shared GPU or the CPU on gloo) and makes its tensors
there (``torch.ones(4, device=device)``: NCCL refuses CPU tensors); tensors come back to the
notebook on the CPU.

* :meth:`World.run` runs a function or a code string on every rank (or on ``ranks=``) and
  returns the per-rank results in rank order; a rank that raises makes it raise
  :class:`RankError` with that rank's traceback, the world stays usable.
* ``%%ranks`` (``%load_ext mpu_lab.labkit.playground``; :func:`start_world` loads it too) runs
  a cell on every rank and prints each rank's output under a ``--- rank N ---`` heading, in
  rank order.
* A collective that only some ranks enter times out after ``timeout_s`` (short, for interactive
  use) and raises :class:`CollectiveTimeout` naming the ranks that did not arrive. gloo closes
  the pairs of a timed-out group, so the group is unusable: :meth:`World.restart` builds a new
  one (a new port, the same engines; new engines if they do not answer).
* :meth:`World.stop` ends every engine and the controller; the cluster is also stopped when
  the interpreter (the notebook kernel) exits.

Modules: :mod:`~mpu_lab.labkit.playground.world` (the controller side),
:mod:`~mpu_lab.labkit.playground.engine` (what runs inside the engines),
:mod:`~mpu_lab.labkit.playground.errors` (what ranks report back),
:mod:`~mpu_lab.labkit.playground.magic` (:func:`start_world` and ``%%ranks``).
"""
from mpu_lab.labkit.playground.errors import (
    HEADING,
    CollectiveTimeout,
    PlaygroundError,
    RankError,
    RankOutput,
    WorldStartTimeout,
)
from mpu_lab.labkit.playground.magic import load_ipython_extension, ranks_magic, start_world
from mpu_lab.labkit.playground.world import (
    DEFAULT_TIMEOUT_S,
    RESTART_PORTS,
    SETUP_RESEND_S,
    START_ATTEMPTS,
    START_TIMEOUT_S,
    World,
    check_world_args,
    current_world,
)

__all__ = [
    "DEFAULT_TIMEOUT_S", "START_TIMEOUT_S", "START_ATTEMPTS", "SETUP_RESEND_S",
    "RESTART_PORTS", "HEADING",
    "PlaygroundError", "RankError", "CollectiveTimeout", "WorldStartTimeout", "RankOutput",
    "World", "check_world_args", "start_world", "current_world", "ranks_magic",
    "load_ipython_extension",
]
