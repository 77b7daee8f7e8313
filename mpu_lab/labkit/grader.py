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
* the unanswered stub (it raises ``NotImplementedError``): ``No answer yet: ...``, naming the
  function that still raises when the learner writes several.

An exercise may ask for several functions (an autograd Function's ``forward`` and ``backward``,
say): its ``parts`` names them, the learner passes them as a tuple in that order, and
``run_case`` receives that tuple.

The reference is always mpu_lab's own implementation, which the package tests hold against the
dense twin and hand-worked values; the grader itself is tested with right answers, wrong ones,
a raising one and a partial collective on a live world
(``tests/labkit/<lab>/test_<lab>_exercises.py``).

The learner's function is sent as ipyparallel sends any function: its code, with the rank's
namespace (``torch``, ``dist``, ``parallel_state``, ``rank``, ``device`` ...) as its globals,
so it must not call other functions defined only in the notebook. A class the learner writes
(a whole module, ``DistributedDataParallel``) travels as its source instead (ipyparallel ships a
notebook class member by member, and a method that calls ``super()`` refers back to its own
class, which it cannot ship): each rank defines it again in its namespace (:class:`ClassSource`).
"""
from __future__ import annotations

import dataclasses
import linecache
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mpu_lab.core import parallel_state
from mpu_lab.labkit import my_megatron
from mpu_lab.labkit.verdict import EMPTY, RIGHT, WRONG, Verdict
from mpu_lab.labkit.playground.errors import CollectiveTimeout, RankError

NOT_WRITTEN = "NotImplementedError"
_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+), in (?P<name>\S+)', re.M)


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
    returns a reason when the world cannot grade this exercise (``None`` when it can),
    ``layout``: ``world_size -> (tp, pp)`` when the exercise needs its own Megatron groups (the
    grader sets them up for the grading and puts the world's back afterwards), and ``parts``:
    the names of the functions when the learner writes several (``("f_forward",
    "f_backward")``): the learner passes a tuple of them, in that order, and ``run_case``
    receives that tuple. A whole piece of Megatron names its ``module`` in the learner's
    package (``"layers.py"``): once right, the grader saves the learner's code there
    (:mod:`mpu_lab.labkit.my_megatron`), under the names in ``saves_as`` (default: the learner's
    own), the names the capstone reads."""

    name: str
    run_case: Callable[[Callable, Case], Outcome]
    cases: Sequence[Case]
    hint: str
    ranks_needed: Optional[Callable[[int, int, int], Optional[str]]] = None
    layout: Optional[Callable[[int], Tuple[int, int]]] = None
    parts: Sequence[str] = ()
    module: Optional[str] = None
    saves_as: Sequence[str] = ()


@dataclasses.dataclass(frozen=True)
class ClassSource:
    """A class the learner wrote, as it travels to the ranks: its ``source`` (as typed, found
    by :func:`mpu_lab.labkit.my_megatron.source_of`), compiled on the rank in the rank's
    namespace at the cell's ``filename`` and ``line``, so a rank's traceback points into the
    learner's cell."""

    name: str
    source: str
    filename: str
    line: int

    @classmethod
    def of(cls, klass: type) -> "ClassSource":
        text = my_megatron.source_of(klass)
        head = text.lstrip().splitlines()[0].strip()
        for member in vars(klass).values():
            code = getattr(getattr(member, "__func__", member), "__code__", None)
            if code is None:
                continue
            lines = linecache.getlines(code.co_filename)
            starts = [i for i in range(min(code.co_firstlineno, len(lines)))
                      if lines[i].strip() == head]
            if starts:
                return cls(klass.__name__, text, code.co_filename, starts[-1] + 1)
        return cls(klass.__name__, text, f"<class {klass.__name__}>", 1)

    def define(self) -> type:
        """Runs inside a rank: the class, defined in a copy of the rank's namespace."""
        from IPython import get_ipython      # the engine's kernel (ipyparallel, an optional extra)
        namespace = dict(get_ipython().user_ns)
        exec(compile("\n" * (self.line - 1) + self.source, self.filename, "exec"), namespace)
        return namespace[self.name]


def _shipped(fn: Callable) -> Any:
    """What travels to the ranks for the learner's ``fn``: a function as it is, a class as its
    :class:`ClassSource`."""
    return ClassSource.of(fn) if isinstance(fn, type) else fn


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


def _watched(fn: Callable, raised: List[str]) -> Callable:
    """``fn``, noting its name in ``raised`` when it raises NotImplementedError (the stub), so
    the verdict can name which of several functions is still unwritten (autograd calls a
    backward from its own engine, where the name would be hard to recover)."""
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotImplementedError:
            raised.append(getattr(fn, "__name__", "your function"))
            raise
    call.__name__ = getattr(fn, "__name__", "call")
    return call


def _grade_on_rank(run_case: Callable, several: bool, case: Case,
                   *learners: Callable) -> Dict[str, Any]:
    """Runs inside a rank: one case. A stub that raises NotImplementedError is reported as such
    (not as an error), every other exception propagates to the world, which reports the rank's
    traceback. Only ``run_case`` travels, not the :class:`Exercise` (its ``layout`` or
    ``ranks_needed`` may be a lambda, which does not pickle). ``learners``: the learner's
    function, or its functions in ``parts`` order when ``several`` (they travel as separate
    arguments: ipyparallel ships a notebook function as code only when it is an argument of
    its own, not inside a tuple)."""
    raised: List[str] = []
    learners = tuple(fn.define() if isinstance(fn, ClassSource) else fn for fn in learners)
    watched = tuple(_watched(fn, raised) for fn in learners)
    try:
        out = run_case(watched if several else watched[0], case)
    except NotImplementedError as exc:
        return {"ok": False, "not_written": True, "message": str(exc),
                "function": raised[0] if raised else ""}
    return dataclasses.asdict(out)


def _tail(traceback_text: str, lines: int = 6) -> str:
    kept = [ln for ln in traceback_text.rstrip().splitlines() if ln.strip()]
    return "\n".join("    " + ln for ln in kept[-lines:])


def _learner_line(traceback_text: str, learners: Sequence[Callable]) -> str:
    """The learner's line where a rank raised: the deepest frame of the traceback in the
    learner's code, with its source looked up here (the ranks have no copy of the notebook's
    cells, so their traceback shows the file and line number only). '' when none is found."""
    codes = [getattr(getattr(m, "__func__", m), "__code__", None) for fn in learners
             for m in ([fn] + (list(vars(fn).values()) if isinstance(fn, type) else []))]
    files = {getattr(code, "co_filename", None) for code in codes}
    found = [m for m in _FRAME.finditer(traceback_text) if m["file"] in files]
    if not found:
        return ""
    m = found[-1]
    source = linecache.getline(m["file"], int(m["line"])).strip()
    return f"  in {m['name']}: {source}" if source else f"  in {m['name']}, line {m['line']}"


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _learners(learner: Any, exercise: Exercise) -> Optional[Tuple[Callable, ...]]:
    """The learner's function(s) as a tuple, or None after printing why they cannot be graded."""
    if not exercise.parts:
        if learner is None or learner is Ellipsis:
            print(f"{EMPTY} write {exercise.name} in the cell above, then run this cell again.")
            return None
        if not callable(learner):
            print(f"{WRONG} {exercise.name} must be a function, got {type(learner).__name__}.")
            return None
        return (learner,)
    names = ", ".join(exercise.parts)
    if learner is None or learner is Ellipsis:
        print(f"{EMPTY} write {names} in the cell above, then run this cell again.")
        return None
    if not isinstance(learner, (tuple, list)) or len(learner) != len(exercise.parts):
        got = (f"{len(learner)} item(s)" if isinstance(learner, (tuple, list))
               else type(learner).__name__)
        print(f"{WRONG} pass the {len(exercise.parts)} functions as a tuple ({names}), "
              f"got {got}.")
        return None
    missing = [n for n, fn in zip(exercise.parts, learner) if fn is None or fn is Ellipsis]
    if missing:
        print(f"{EMPTY} write {', '.join(missing)} in the cell above, then run this cell again.")
        return None
    bad = [f"{n} is not a function (got {type(fn).__name__})"
           for n, fn in zip(exercise.parts, learner) if not callable(fn)]
    if bad:
        print(f"{WRONG} {'; '.join(bad)}: pass the functions {names}, in that order.")
        return None
    return tuple(learner)


def grade(learner: Any, exercise: Exercise, world) -> Verdict:
    """Run ``learner`` (the learner's function; a tuple of functions in ``exercise.parts``
    order when the exercise asks for several) against ``exercise`` on every rank of ``world``
    (a playground :class:`~mpu_lab.labkit.playground.World`) and print one verdict. Returns a
    :class:`Verdict`."""
    learners = _learners(learner, exercise)
    if learners is None:
        return Verdict(False)
    if not world.running:
        print(f"{WRONG} this world is stopped: start one with playground.start_world(...) and "
              f"grade on it.")
        return Verdict(False)
    if exercise.ranks_needed is not None:
        reason = exercise.ranks_needed(world.world_size, world.tp, world.pp)
        if reason:
            print(f"{WRONG} this world cannot grade {exercise.name}: {reason}")
            return Verdict(False)
    if world.broken:
        print(f"(the world needed a restart: {world.broken}; restarted it first)")
        world.restart()
    if exercise.layout is None:
        verdict = _grade_cases(learners, exercise, world)
    else:
        world.run(_regroup, *exercise.layout(world.world_size))
        try:
            verdict = _grade_cases(learners, exercise, world)
        finally:
            if world.running and not world.broken:
                world.run(_regroup, world.tp, world.pp)
    if verdict and exercise.module:
        _save(learners, exercise)
    return verdict


def _save(learners: Tuple[Callable, ...], exercise: Exercise) -> None:
    """Save a right whole piece into the learner's package, and say where."""
    try:
        path = my_megatron.save_piece(learners, exercise.module, exercise.saves_as)
    except (OSError, TypeError, SyntaxError, ValueError) as exc:
        print(f"(not saved to the package: {exc})")
        return
    names = ", ".join(exercise.saves_as or [fn.__name__ for fn in learners])
    print(f"saved: {path.parent.name}/{path.name} ({names})")
    reads = my_megatron.rank_values_read(learners)
    if reads:
        print(f"note: it reads {', '.join(reads)}, which only the grader's ranks define: "
              f"call those in the code so the capstone can run it")


def _timeout_verdict(exc: CollectiveTimeout, case: Case, exercise: Exercise, world,
                     learners: Sequence[Callable]) -> None:
    """Print what a collective that only some ranks entered looks like: who waited, who never
    came and what those did instead (finished the case, or raised)."""
    raised = {r: o for r, o in exc.failures.items() if r not in exc.waiting}
    finished = [o.rank for o in exc.outputs if not o.error]
    instead = []
    if finished:
        instead.append(f"{_ranks_text(finished)} finished input '{case.name}' without it")
    for r, o in sorted(raised.items()):
        where = _learner_line(o.traceback, learners)
        instead.append(f"rank {r} raised {o.error.splitlines()[0]}" + (f" ({where.strip()})"
                                                                       if where else ""))
    if exc.missing:
        why = "; ".join(instead) or "they called different collectives"
        stuck = (f"waited {world.timeout_s:g} s in a collective that "
                 f"{_ranks_text(exc.missing)} never entered ({why})")
    else:        # everyone waited: a deadlock, or each rank in a different call
        stuck = (f"each waited {world.timeout_s:g} s in a collective or send/receive that its "
                 f"peers never joined (a deadlock, or different calls on different ranks)")
    print(f"{WRONG} on input '{case.name}' {_ranks_text(exc.waiting)} {stuck}: every rank "
          f"of a group must make the same collective calls, on the same group, in the same "
          f"order. (The world was restarted.)\nHint: {exercise.hint}")


def graded_name(learners: Sequence[Callable], exercise: Exercise) -> str:
    """The name a verdict gives what was graded: the exercise's own (``my_column_forward``)
    when the functions carry the names the learner was asked to write, else the functions' own
    names, so a solution (``solution_column_forward``) never passes as the learner's function."""
    names = [getattr(fn, "__name__", "function") for fn in learners]
    if exercise.parts:
        if tuple(names) == tuple(exercise.parts):
            return exercise.name
        return f"{exercise.name.split(' (')[0]} ({', '.join(names)})"
    return exercise.name if exercise.name.split("(")[0] == names[0] else names[0]


def _grade_cases(learners: Tuple[Callable, ...], exercise: Exercise, world) -> Verdict:
    try:
        shipped = tuple(_shipped(fn) for fn in learners)
    except OSError as exc:          # a class whose source is nowhere (typed outside a cell)
        print(f"{WRONG} {exc}.")
        return Verdict(False)
    for case in exercise.cases:
        try:
            replies = world.run(_grade_on_rank, exercise.run_case, bool(exercise.parts), case,
                                *shipped)
        except CollectiveTimeout as exc:
            world.restart()
            _timeout_verdict(exc, case, exercise, world, learners)
            return Verdict(False)
        except RankError as exc:
            rank, out = min(exc.failures.items())
            where = _learner_line(out.traceback, learners)
            print(f"{WRONG} on input '{case.name}' rank {rank} raised {out.error}\n"
                  + (f"{where}\n" if where else "")
                  + f"{_tail(out.traceback)}\nHint: {exercise.hint}")
            if world.broken:
                world.restart()
            return Verdict(False)
        unwritten = [r for r in replies if r.get("not_written")]
        if unwritten:
            fn = unwritten[0].get("function") or exercise.name
            print(f"{EMPTY} {fn} still raises NotImplementedError:\n"
                  f"write its body, then run this cell again.")
            return Verdict(False)
        for rank, reply in zip(world._ranks(None), replies):
            if not reply["ok"]:
                print(f"{WRONG} rank {rank}, input '{case.name}': {reply['what']} expected "
                      f"{reply['expected']}, got {reply['got']}.\nHint: {exercise.hint}")
                return Verdict(False)
    count = len(exercise.cases)
    print(f"{RIGHT} {graded_name(learners, exercise)} agrees with the reference on all "
          f"{world.world_size} ranks "
          f"for {count} input{'s' if count != 1 else ''}: "
          + "; ".join(c.name for c in exercise.cases) + ".")
    return Verdict(True)
