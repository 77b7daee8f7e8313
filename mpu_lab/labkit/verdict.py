"""What every lab's checks share: the :class:`Verdict`, the printed verdict line, and the parsing
of a learner's answer (a list, a tuple, a ``torch.Size``, a tensor, a number)."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

from mpu_lab.core import parallel_state

RIGHT, WRONG, EMPTY = "Right:", "Not yet:", "No answer yet:"
# A question's answer is shown only after the learner has committed to answers of their own:
# at the second wrong answer to the same question (see verdict()), never before.
ANSWER_AFTER_TRIES = 2
_wrong_tries: Dict[str, int] = {}


class Verdict:
    """What a check returns: true when the answer is right. It shows nothing in a notebook
    (the printed line is the verdict), so a check can end a cell without an ``Out[]``."""

    def __init__(self, ok: bool):
        self.ok = bool(ok)

    def __bool__(self) -> bool:
        return self.ok

    def __eq__(self, other) -> bool:
        if isinstance(other, (bool, Verdict)):
            return self.ok == bool(other)
        return NotImplemented

    def __hash__(self):
        return hash(self.ok)

    def __repr__(self) -> str:
        return f"Verdict({self.ok})"

    def _ipython_display_(self):
        pass


def verdict(ok: bool, right: str, wrong: str, answer: Optional[str] = None,
            reveal: bool = True) -> Verdict:
    """Print ``Right: <right>`` or ``Not yet: <wrong>`` (a hint, never the answer). A question
    answered wrong :data:`ANSWER_AFTER_TRIES` times gets its answer printed after the hint: the
    labs keep no written solutions to their questions, so this is where a learner who is stuck
    finds one. The answer is ``answer`` when the ``right`` text speaks of the learner's own
    answer, else ``right`` (which then states it); it also names the question, so each
    question counts its own tries. ``reveal=False``: a check of a job's results, not a
    question."""
    if ok:
        print(f"{RIGHT} {right}")
        return Verdict(True)
    print(f"{WRONG} {wrong}")
    shown = answer if answer is not None else right
    if reveal and shown:
        tries = _wrong_tries[shown] = _wrong_tries.get(shown, 0) + 1
        if tries >= ANSWER_AFTER_TRIES:
            print(f"The answer, after {tries} tries: {shown}")
    return Verdict(False)


def forget_tries() -> None:
    """Start every question's count of wrong answers again (a new learner, a new test)."""
    _wrong_tries.clear()


def unanswered(answer: Any, what: str) -> bool:
    if answer is None or answer is Ellipsis:
        print(f"{EMPTY} replace None with {what}.")
        return True
    return False


def as_int_list(answer: Any) -> Optional[List[int]]:
    """``answer`` as a list of ints (from a list, tuple, torch.Size, range or tensor), or None."""
    if hasattr(answer, "tolist") and not isinstance(answer, (list, tuple)):
        answer = answer.tolist()
    try:
        items = list(answer)
    except TypeError:
        return None
    out = []
    for item in items:
        if isinstance(item, bool):
            return None
        try:
            value = int(item)
        except (TypeError, ValueError):
            return None
        if value != item:
            return None
        out.append(value)
    return out


def as_int(answer: Any) -> Optional[int]:
    if isinstance(answer, bool):
        return None
    try:
        value = int(answer)
    except (TypeError, ValueError):
        return None
    return value if value == answer else None


def as_floats(answer: Any) -> Optional[List[float]]:
    """A number, a (nested) list or a tensor, flattened to floats; None if it is not numbers."""
    if hasattr(answer, "tolist"):
        answer = answer.tolist()
    flat, todo = [], [answer]
    while todo:
        item = todo.pop(0)
        if isinstance(item, (list, tuple)):
            todo = list(item) + todo
        elif isinstance(item, bool):
            return None
        else:
            try:
                flat.append(float(item))
            except (TypeError, ValueError):
                return None
    return flat


def summarize(results: Iterable[bool]) -> str:
    """``3 of 4 right`` for a list of check results."""
    results = list(results)
    return f"{sum(bool(r) for r in results)} of {len(results)} right"


def tp_group_of(rank: int, world_size: int, tp: int, pp: int = 1) -> List[int]:
    """The tensor-parallel group (global ranks, Megatron's order) that holds ``rank``."""
    (group,) = [g for g in parallel_state.generate_rank_groups(world_size, tp, pp)["tp"]
                if rank in g]
    return group


def check_tensor(answer: Any, expected: List, what: str, why: str, hint: str) -> Verdict:
    if unanswered(answer, what):
        return Verdict(False)
    return verdict(as_floats(answer) == as_floats(expected), f"{expected}: {why}",
                    f"{answer!r} is not it. {hint}")
