"""The parallel-size flags of ``launch/rank_groups.py`` (``--tp``, ``--pp``, ``--cp``, ``--ep``,
``--etp``, ``--order``; the expert ones also under Megatron's names,
``--expert-model-parallel-size`` and ``--expert-tensor-parallel-size``) and their pure check,
:func:`check_rank_groups_args` — the script's ``PRECHECK``, run by the launcher before torchrun
starts: the sizes against the world in flag names, then the checks of
:func:`mpu_lab.core.parallel_state.generate_rank_groups` (Megatron-core's ``parallel_state``
``initialize_model_parallel`` arguments, as short flags) as a backstop. The script itself calls
:func:`parse_and_check_args` (one message on rank 0, exit status 2:
:mod:`~mpu_lab.training.flag_errors`). The script builds its parser here, so the flags and the
check are defined once."""
from __future__ import annotations

import argparse
import math
from typing import Optional, Sequence

from mpu_lab.core.parallel_state import DEFAULT_ORDER, generate_rank_groups
from mpu_lab.core.utils import divisors
from mpu_lab.training import flag_errors
from mpu_lab.training.flag_errors import NPROC, FlagError, join_or, multiples_near


def rank_groups_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    """The flags of ``launch/rank_groups.py``: the sizes and the order of the rank groups."""
    parser = flag_errors.ArgumentParser(prog="rank_groups.py", description=description)
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
    ``ValueError`` naming the flags, no process started). ``cwd`` is unused (no paths)."""
    args = rank_groups_parser().parse_args([str(a) for a in argv])
    check_rank_groups(args, world_size)
    return args


def parse_and_check_args(argv: Optional[Sequence[str]] = None,
                         description: Optional[str] = None) -> argparse.Namespace:
    """What the script calls first: parse and check for the world torchrun launched; a
    configuration that cannot work is refused before any process group starts (one message
    on rank 0, exit status 2)."""
    return flag_errors.parse_for_launch(rank_groups_parser(description), argv, check_rank_groups,
                                        fewest_ranks)


def fewest_ranks(args) -> int:
    """The fewest ranks the sizes fit: a multiple of tp x cp x pp and of etp x ep x pp."""
    etp = args.tp if args.etp is None else args.etp
    return math.lcm(max(1, args.tp * args.cp * args.pp), max(1, etp * args.ep * args.pp))


def check_rank_groups(args, world_size: int) -> None:
    """The sizes against ``world_size``; each value a refusal suggests is tried with the other
    flags as given and kept only if it passes."""
    given = argparse.Namespace(**vars(args))
    try:
        _check(args, world_size)
    except FlagError as exc:
        raise exc.keeping(lambda flag, value: _works(given, world_size, flag, value)) from None


def _works(given, world_size: int, flag: str, value) -> bool:
    trial = argparse.Namespace(**vars(given))
    if flag == NPROC:
        world_size = value
    else:
        setattr(trial, flag.lstrip("-"), value)
    try:
        _check(trial, world_size)
    except ValueError:
        return False
    return True


def _check(args, world_size: int) -> None:
    for name in ("tp", "pp", "cp", "ep", "etp"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    tp, pp, cp, ep = args.tp, args.pp, args.cp, args.ep
    etp = tp if args.etp is None else args.etp
    dense = tp * cp * pp
    if world_size % dense:
        given = [f"--{n} {v}" for n, v in (("tp", tp), ("cp", cp), ("pp", pp)) if v > 1]
        raise FlagError(
            f"{join_or(given, 'and')} {'does' if len(given) == 1 else 'do'} not fit {world_size} "
            f"ranks: world size {world_size} is not divisible by tp x cp x pp = {tp} x {cp} x "
            f"{pp} = {dense} (world = tp x cp x dp x pp)",
            {**{f"--{n}": divisors(world_size) for n, v in (("tp", tp), ("cp", cp), ("pp", pp))
                if v > 1}, NPROC: multiples_near(world_size, dense)})
    experts = etp * ep * pp
    if world_size % experts:
        raise FlagError(
            f"--ep {ep} with --etp {etp} does not fit {world_size} ranks: world size "
            f"{world_size} is not divisible by etp x ep x pp = {etp} x {ep} x {pp} = {experts} "
            f"(the expert layers lay out world = etp x ep x edp x pp)",
            {"--ep": divisors(world_size), "--etp": divisors(world_size),
             NPROC: multiples_near(world_size, math.lcm(dense, experts))})
    try:
        generate_rank_groups(world_size, tp, pp, cp, args.order, ep, args.etp)
    except ValueError as exc:
        raise FlagError(f"--order {args.order}: {exc}", {"--order": [DEFAULT_ORDER]}) from None
