"""The parallel-size flags of ``launch/rank_groups.py`` (``--tp``, ``--pp``, ``--cp``, ``--ep``,
``--etp``, ``--order``; the expert ones also under Megatron's names,
``--expert-model-parallel-size`` and ``--expert-tensor-parallel-size``) and their pure check, :func:`check_rank_groups_args` — the script's ``PRECHECK``,
run by the launcher before torchrun starts: the sizes checks of
:func:`mpu_lab.core.parallel_state.generate_rank_groups` (Megatron-core's ``parallel_state``
``initialize_model_parallel`` arguments, as short flags). The script builds its parser here, so
the flags and the check are defined once."""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from mpu_lab.core.parallel_state import DEFAULT_ORDER, generate_rank_groups


def rank_groups_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    """The flags of ``launch/rank_groups.py``: the sizes and the order of the rank groups."""
    parser = argparse.ArgumentParser(prog="rank_groups.py", description=description)
    parser.add_argument("--tp", type=int, default=2, help="tensor-model-parallel size t")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-model-parallel size p")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size c")
    parser.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=1,
                        help="expert-model-parallel size (mixture-of-experts layers)")
    parser.add_argument("--etp", "--expert-tensor-parallel-size", dest="etp", type=int,
                        default=None, help="expert-tensor-parallel size (default: --tp)")
    parser.add_argument("--order", default=DEFAULT_ORDER,
                        help="parallel dimensions, fastest-varying first (default %(default)s)")
    return parser


def check_rank_groups_args(argv: Sequence[str], world_size: int, cwd=None) -> argparse.Namespace:
    """Parse ``argv`` and check the sizes and order for ``world_size`` ranks (pure: a
    ``ValueError`` naming the numbers, no process started). ``cwd`` is unused (no paths)."""
    args = rank_groups_parser().parse_args([str(a) for a in argv])
    generate_rank_groups(world_size, args.tp, args.pp, args.cp, args.order, args.ep, args.etp)
    return args
