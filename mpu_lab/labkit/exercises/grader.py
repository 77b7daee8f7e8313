"""Graders for write-the-code exercises: the learner's function runs on a live multi-rank world.

A "write this function" exercise is an :class:`Exercise`: the name of what the learner writes,
a module-level ``run_case(learner, case) -> Outcome`` that runs inside every rank (it builds the
inputs on the rank's device, calls the learner's function and the reference, and compares), a
few :class:`Case` s (edge cases included) and a hint. :func:`grade` sends the learner's function
to every rank of a playground world (:mod:`mpu_lab.labkit.playground`), runs each case on all
ranks at once (so the learner's collectives really run), and prints one verdict:

* right on every rank and every case: ``Right: ...``;
* the first case and rank that disagree: which rank, which input, expected and got, and the hint;
* a rank that raised: its error and the last lines of its traceback;
* a collective that only some ranks entered: which ranks waited, which never came (the world is
  restarted so the next try runs on a fresh group);
* the unanswered stub (it raises ``NotImplementedError``): ``No answer yet: ...``.

The reference is always mpu_lab's own implementation, which the package tests hold against the
dense twin and hand-worked values; the grader itself is tested with a right and a wrong answer
on a live world (``tests/test_exercise_graders*.py``).

The learner's function is sent as ipyparallel sends any function: its code, with the rank's
namespace (``torch``, ``dist``, ``parallel_state``, ``rank``, ``device`` ...) as its globals,
so it must not call other functions defined only in the notebook.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from mpu_lab import parallel_state
from mpu_lab.labkit.exercises.common import EMPTY, RIGHT, WRONG, Verdict
from mpu_lab.labkit.playground.errors import CollectiveTimeout, RankError

NOT_WRITTEN = "NotImplementedError"


@dataclasses.dataclass(frozen=True)
class Case:
    """One input of an exercise: a name the verdict quotes and the parameters ``run_case`` reads
    (plain Python values, so they travel to the ranks)."""

    name: str
    params: Dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Outcome:
    """What one rank found for one case: ``ok``, and when not, what was ``expected`` and what the
    learner's function ``got`` (short text: a shape, a rounded tensor), and ``what`` differed
    (``"forward"``, ``"x.grad"``...)."""

    ok: bool
    what: str = ""
    expected: str = ""
    got: str = ""


@dataclasses.dataclass(frozen=True)
class Exercise:
    """A write-the-code exercise: ``name`` of the function the learner writes, ``run_case`` (a
    module-level function: it runs on each rank as ``run_case(learner, case)``), the cases, the
    hint printed with a wrong answer, ``ranks_needed``: a check on the world's sizes that
    returns a reason when the world cannot grade this exercise (``None`` when it can), and
    ``layout``: ``world_size -> (tp, pp)`` when the exercise needs its own Megatron groups (the
    grader sets them up for the grading and puts the world's back afterwards)."""

    name: str
    run_case: Callable[[Callable, Case], Outcome]
    cases: Sequence[Case]
    hint: str
    ranks_needed: Optional[Callable[[int, int, int], Optional[str]]] = None
    layout: Optional[Callable[[int], Tuple[int, int]]] = None


def _regroup(tp: int, pp: int) -> None:
    """Runs inside a rank: Megatron's groups for (tp, pp) over the same world."""
    parallel_state.initialize_model_parallel(tp, pp)


def show(t: Any, digits: int = 4, limit: int = 12) -> str:
    """A tensor (or number, or list) as short text for a verdict: rounded, at most ``limit``
    values, its shape when it has one."""
    if hasattr(t, "detach"):
        flat = [round(float(v), digits) for v in t.detach().float().cpu().flatten().tolist()]
        body = ", ".join(f"{v:g}" for v in flat[:limit]) + (", ..." if len(flat) > limit else "")
        return f"shape {tuple(t.shape)} [{body}]"
    return repr(t)


def compare(what: str, expected: Any, got: Any, atol: float = 1e-6, rtol: float = 1e-5) -> Outcome:
    """Compare a tensor the learner produced with the reference's: shape first, then values."""
    if got is None or not hasattr(got, "shape"):
        return Outcome(False, what, show(expected), f"{type(got).__name__} {got!r:.60}")
    if tuple(got.shape) != tuple(expected.shape):
        return Outcome(False, what, f"shape {tuple(expected.shape)}", f"shape {tuple(got.shape)}")
    diff = (got.detach().float().cpu() - expected.detach().float().cpu()).abs()
    bound = atol + rtol * expected.detach().float().cpu().abs()
    if bool((diff > bound).any()) or not bool(got.isfinite().all()):
        return Outcome(False, what, show(expected), show(got))
    return Outcome(True, what)


def _grade_on_rank(learner: Callable, exercise: Exercise, case: Case) -> Dict[str, Any]:
    """Runs inside a rank: one case. A stub that raises NotImplementedError is reported as such
    (not as an error), every other exception propagates to the world, which reports the rank's
    traceback."""
    try:
        out = exercise.run_case(learner, case)
    except NotImplementedError as exc:
        return {"ok": False, "not_written": True, "message": str(exc)}
    return dataclasses.asdict(out)


def _tail(traceback_text: str, lines: int = 6) -> str:
    kept = [ln for ln in traceback_text.rstrip().splitlines() if ln.strip()]
    return "\n".join("    " + ln for ln in kept[-lines:])


def grade(learner: Optional[Callable], exercise: Exercise, world) -> Verdict:
    """Run ``learner`` (the learner's function) against ``exercise`` on every rank of ``world``
    (a playground :class:`~mpu_lab.labkit.playground.World`) and print one verdict. Returns a
    :class:`Verdict`."""
    if learner is None or learner is Ellipsis:
        print(f"{EMPTY} write {exercise.name} in the cell above, then run this cell again.")
        return Verdict(False)
    if not callable(learner):
        print(f"{WRONG} {exercise.name} must be a function, got {type(learner).__name__}.")
        return Verdict(False)
    if exercise.ranks_needed is not None:
        reason = exercise.ranks_needed(world.world_size, world.tp, world.pp)
        if reason:
            print(f"{WRONG} this world cannot grade {exercise.name}: {reason}")
            return Verdict(False)
    if exercise.layout is None:
        return _grade_cases(learner, exercise, world)
    world.run(_regroup, *exercise.layout(world.world_size))
    try:
        return _grade_cases(learner, exercise, world)
    finally:
        if world.running and not world.broken:
            world.run(_regroup, world.tp, world.pp)


def _grade_cases(learner: Callable, exercise: Exercise, world) -> Verdict:
    for case in exercise.cases:
        try:
            replies = world.run(_grade_on_rank, learner, exercise, case)
        except CollectiveTimeout as exc:
            world.restart()
            stuck = (f"ranks {exc.waiting} waited in a collective that ranks {exc.missing} never "
                     f"entered" if exc.missing else
                     f"ranks {exc.waiting} each waited in a collective that its peers never "
                     f"joined (they called different collectives, or on different groups)")
            print(f"{WRONG} on input '{case.name}' {stuck}: every rank of a group must make the "
                  f"same collective calls, on the same group, in the same order. (The world was "
                  f"restarted.)\nHint: {exercise.hint}")
            return Verdict(False)
        except RankError as exc:
            rank, out = min(exc.failures.items())
            print(f"{WRONG} on input '{case.name}' rank {rank} raised {out.error}\n"
                  f"{_tail(out.traceback)}\nHint: {exercise.hint}")
            if world.broken:
                world.restart()
            return Verdict(False)
        if any(r.get("not_written") for r in replies):
            print(f"{EMPTY} {exercise.name} still raises NotImplementedError: write its body, "
                  f"then run this cell again.")
            return Verdict(False)
        for rank, r in enumerate(world._ranks(None)):
            reply = replies[rank]
            if not reply["ok"]:
                print(f"{WRONG} rank {r}, input '{case.name}': {reply['what']} expected "
                      f"{reply['expected']}, got {reply['got']}.\nHint: {exercise.hint}")
                return Verdict(False)
    count = len(exercise.cases)
    print(f"{RIGHT} {exercise.name} agrees with the reference on all {world.world_size} ranks "
          f"for {count} input{'s' if count != 1 else ''}: "
          + "; ".join(c.name for c in exercise.cases) + ".")
    return Verdict(True)

