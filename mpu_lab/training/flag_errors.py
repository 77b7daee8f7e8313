"""A configuration that cannot work is refused before any process group starts: one message,
printed by rank 0 only, exit status 2 (argparse's), in flag names.

Under ``torchrun --nproc-per-node 4`` every rank parses the same flags and finds the same fault;
if each raised, the message would come four times inside torch elastic's tracebacks. Here:

* :class:`FlagError`: a ``ValueError`` naming the flags and their values, with the values of
  flags that would fix it (``fixes``); :meth:`FlagError.keeping` keeps only those that pass
  every check (``validate_args`` asks), so following a suggestion never leads to a second
  error.
* :class:`ArgumentParser`: argparse whose usage, help and errors rank 0 prints alone.
* :func:`refuse`: the message on rank 0 and exit status 2. The other ranks print nothing and
  wait for torchrun to stop them once rank 0 has exited (then exit 2 too): a rank that left
  first could get rank 0 stopped before it prints.
* :func:`parse_for_launch`: parse, then check for the world torchrun launched; under plain
  ``python`` (no ``WORLD_SIZE``) check for the fewest ranks the flags need and say how to
  launch them.

Megatron's ``validate_args`` asserts on every rank and its ``print_rank_0`` prints on one; this
is the two together, for a message a newcomer reads once.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from typing import Any, Callable, Dict, Mapping, NoReturn, Optional, Sequence

NPROC = "--nproc-per-node"     # a fix that changes the number of ranks (torchrun's flag)
WAIT_S = 30.0                  # how long a rank other than 0 waits for torchrun to stop it


def launch_rank() -> int:
    """This process's global rank under torchrun (``RANK``); 0 outside it."""
    return int(os.environ.get("RANK", "0") or 0)


def launched_world_size() -> Optional[int]:
    """The world torchrun launched (``WORLD_SIZE``), or None under plain ``python``."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


def join_or(values: Sequence[Any], word: str = "or") -> str:
    """``[1, 2, 4]`` -> ``"1, 2 or 4"``."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {word} {words[-1]}"


def multiples_near(n: int, step: int) -> list:
    """The multiples of ``step`` on either side of ``n`` (0 and ``n`` itself left out)."""
    below, above = n // step * step, (n // step + 1) * step
    return [m for m in (below, above) if m > 0 and m != n]


def _fix_text(flag: str, values: Sequence[Any]) -> str:
    if flag == NPROC:
        return f"{join_or(values)} ranks (torchrun {NPROC})"
    if len(values) == 1 and (isinstance(values[0], bool) or values[0] is None):
        return f"add {flag}" if values[0] else f"leave out {flag}"
    return f"{flag} {join_or(values)}"


class FlagError(ValueError):
    """A configuration refused in flag names: ``problem`` says what does not fit (flags and
    values), ``fixes`` maps a flag (or :data:`NPROC`, the number of ranks) to values that may
    fix it, each on its own with the other flags as given (``True``: add a switch; ``False`` or
    ``None``: leave the flag out). ``checked``: the fixes were each tried
    (:meth:`keeping`)."""

    def __init__(self, problem: str, fixes: Optional[Mapping[str, Sequence[Any]]] = None,
                 checked: bool = False):
        self.problem, self.checked = problem, checked
        self.fixes: Dict[str, list] = {}
        for flag, values in (fixes or {}).items():
            kept = list(dict.fromkeys(values))      # in order, once each
            if kept:
                self.fixes[flag] = kept
        super().__init__(self._text(fixes or {}))

    def _text(self, asked: Mapping[str, Sequence[Any]]) -> str:
        if self.fixes:
            lead = "valid with the other flags as given" if self.checked else "try"
            return f"{self.problem}; {lead}: " + "; or ".join(
                _fix_text(flag, values) for flag, values in self.fixes.items())
        flags = [f for f in asked if f != NPROC]
        if self.checked and flags:
            return (f"{self.problem}; no value of {join_or(flags)} alone fits the other flags "
                    f"as given")
        return self.problem

    def keeping(self, works: Callable[[str, Any], bool]) -> "FlagError":
        """This error with only the fixes for which ``works(flag, value)`` is true."""
        return FlagError(self.problem, {flag: [v for v in values if works(flag, v)]
                                        for flag, values in self.fixes.items()}, checked=True)


def _leave_silently(status: int) -> NoReturn:
    """A rank other than 0 refuses without a word: rank 0 prints the message. Exiting at once
    could get rank 0 stopped by torchrun before it printed (ranks import at different
    speeds), so wait for torchrun to stop this rank once rank 0 has exited — and then exit with
    the same status — or ``WAIT_S`` at most."""
    sys.stdout.flush()
    try:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(status))
    except ValueError:      # not the main thread: no handler, torchrun's SIGTERM ends it
        pass
    time.sleep(WAIT_S)
    sys.exit(status)


def refuse(prog: str, message: str, status: int = 2) -> NoReturn:
    """Refuse the configuration: ``prog: error: message`` on rank 0 (stderr), exit ``status``
    (2, argparse's) on every rank."""
    if launch_rank() != 0:
        _leave_silently(status)
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose messages (usage, ``--help``, errors) rank 0 prints alone; every rank
    exits as argparse does (status 2 on an error). A usage longer than a few lines is left out
    of an error (``--help`` shows it)."""

    def print_usage(self, file=None):
        if launch_rank() == 0:
            super().print_usage(file)

    def print_help(self, file=None):
        if launch_rank() == 0:
            super().print_help(file)

    def error(self, message: str) -> NoReturn:
        if launch_rank() != 0:
            _leave_silently(2)
        usage = self.format_usage()
        if usage.count("\n") > 3:
            usage = f"usage: {self.prog} [flags] ({self.prog} --help lists them)\n"
        self._print_message(usage, sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def torchrun_command(script: str, argv: Sequence[str], nproc: int) -> str:
    return shlex.join(["torchrun", "--standalone", NPROC, str(nproc), script, *map(str, argv)])


def parse_for_launch(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]],
                     check: Callable[[argparse.Namespace, int], Any],
                     fewest_ranks: Callable[[argparse.Namespace], int]) -> argparse.Namespace:
    """Parse ``argv`` and ``check(args, world_size)`` before any process group starts; a
    ``ValueError`` is refused (:func:`refuse`). Under torchrun the world is ``WORLD_SIZE``.
    Under plain ``python`` there is no world to start: the flags are checked for
    ``fewest_ranks(args)`` ranks and refused either way, with the torchrun line to use."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parser.parse_args(argv)
    world = launched_world_size()
    if world is not None:
        try:
            check(args, world)
        except ValueError as exc:
            refuse(parser.prog, str(exc))
        return args
    script = sys.argv[0] if sys.argv[0].endswith(parser.prog) else f"launch/{parser.prog}"
    trial = argparse.Namespace(**vars(args))
    n = max(1, fewest_ranks(trial))
    try:
        check(trial, n)
    except ValueError as exc:
        refuse(parser.prog, f"{exc}\n  (checked for {n} rank{'s' if n > 1 else ''}, the fewest "
                            f"these sizes need: plain python starts no ranks; run it under "
                            f"torchrun: torchrun --standalone {NPROC} N {script} ...)")
    refuse(parser.prog, f"RANK and WORLD_SIZE are not set: run it under torchrun (the flags "
                        f"check out for {n} rank{'s' if n > 1 else ''}, the fewest they need):"
                        f"\n  {torchrun_command(script, argv, n)}")
