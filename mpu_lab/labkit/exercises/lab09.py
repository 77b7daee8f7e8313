"""Lab 09's checks: name the cause of a broken job from its diagnosis (:func:`check_cause`), the
rank to look at first (:func:`check_culprit`), and the write-the-code exercise
:data:`EXCHANGE`: one pipeline stage's blocking sends and receives with its neighbours, in an
order that cannot deadlock, run with real point-to-point messages on a live world."""
from __future__ import annotations

import string
from typing import Any, Callable, Dict, Optional

import torch

from mpu_lab import distributed, parallel_state
from mpu_lab.labkit.exercises.common import Verdict, as_int, unanswered, verdict
from mpu_lab.labkit.exercises.grader import Case, Exercise, Outcome, compare, show
from mpu_lab.labkit.faults import FAULT_KINDS


# --------------------------------------------------------------------------- name the cause
def suspects() -> Dict[str, str]:
    """The list of causes the learner picks from: ``{letter: cause}``, one per fault kind of
    :data:`mpu_lab.labkit.faults.FAULT_KINDS`, ordered by the cause's text (so the letters
    do not follow the lab's sections)."""
    causes = sorted(FAULT_KINDS[kind]["cause"] for kind in FAULT_KINDS)
    return dict(zip(string.ascii_uppercase, causes))


def letter_of(kind: str) -> str:
    """The letter of ``kind``'s cause in :func:`suspects`."""
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; the kinds are {sorted(FAULT_KINDS)}")
    cause = FAULT_KINDS[kind]["cause"]
    return next(letter for letter, text in suspects().items() if text == cause)


def print_suspects() -> None:
    """Print the causes, one per line, with their letters."""
    for letter, cause in suspects().items():
        print(f"{letter}. {cause}")


def check_cause(answer: Any, kind: str) -> Verdict:
    """The letter (see :func:`print_suspects`) of the cause behind the fault ``kind``."""
    letters = suspects()
    if unanswered(answer, f"a letter {', '.join(letters)} from the list of causes"):
        return Verdict(False)
    expected = letter_of(kind)
    given = str(answer).strip().upper().rstrip(".")
    if given not in letters:
        print(f"Not yet: {answer!r} is not one of the letters {', '.join(letters)}.")
        return Verdict(False)
    return verdict(given == expected,
                    f"{expected}. {letters[expected]}",
                    f"{given} ({letters[given]}) does not fit this report. Hint: "
                    f"{FAULT_KINDS[kind]['what']} Which ranks waited, in which call, and "
                    f"where were the others?")


def check_culprit(answer: Any, fault: str) -> Verdict:
    """The rank to look at first: the one the fault ``fault`` (``"KIND:RANK[:ITERATION]"``,
    as given to ``--inject-fault``) was injected into."""
    if unanswered(answer, "a rank number"):
        return Verdict(False)
    parts = fault.split(":")
    if len(parts) < 2 or not parts[1].isdigit():
        raise ValueError(f"fault {fault!r} names no rank: write it KIND:RANK[:ITERATION]")
    expected = int(parts[1])
    return verdict(as_int(answer) == expected,
                    f"rank {expected} is the one that misbehaved; the ranks that raised first "
                    f"only timed out waiting for it.",
                    f"{answer!r} is not it. Hint: the rank that raised first waited in a "
                    f"collective; look for the rank that was somewhere else.")


# --------------------------------------------------------------------------- write the code
# The learner writes ``my_exchange(stage, num_stages, mine)``: send ``mine`` to both neighbour
# stages and receive theirs with blocking dist.send / dist.recv. Graded live, every rank one
# stage: an order in which two neighbours both send first (or both receive first) waits
# forever, and the world's collective timeout ends it; an order that runs is checked for what
# each stage received.
def _all_stages(world_size: int):
    """The grading layout: tensor-parallel size 1, every rank one pipeline stage."""
    return 1, world_size


def _two_ranks_or_more(world_size: int, tp: int, pp: int) -> Optional[str]:
    return None if world_size >= 2 else f"it needs 2 ranks or more, this world has {world_size}"


def message_of(stage: int, shape, device=None) -> torch.Tensor:
    """What stage ``stage`` sends its neighbours: ``100 * stage + 0, 1, 2, ...`` in ``shape``
    (so a message names the stage it came from)."""
    n = 1
    for size in shape:
        n *= size
    return (100.0 * stage + torch.arange(n, dtype=torch.float32, device=device)).reshape(shape)


def run_exchange_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank (one pipeline stage each): the learner's exchange of this stage's
    message with its neighbours, then what it returned against the neighbours' messages."""
    p = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    device = distributed.get_device()
    shape = tuple(case.params["shape"])
    got = learner(stage, p, message_of(stage, shape, device))
    where = f"stage {stage} of {p}:"
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return Outcome(False, f"{where} what my_exchange returned",
                       "a pair (from_prev, from_next)", f"{type(got).__name__} {got!r:.60}")
    for name, peer, value in (("from_prev", stage - 1, got[0]), ("from_next", stage + 1, got[1])):
        if not 0 <= peer < p:
            if value is not None:
                return Outcome(False, f"{where} {name} (there is no stage {peer})", "None",
                               show(value))
            continue
        out = compare(f"{where} {name} (stage {peer}'s message)",
                      message_of(peer, shape, device), value)
        if not out.ok:
            return out
    return Outcome(True)


EXCHANGE = Exercise(
    name="my_exchange",
    run_case=run_exchange_case,
    cases=[
        Case("a 1-element message", dict(shape=[1])),
        Case("a [2, 4] activation", dict(shape=[2, 4])),
        Case("a [3, 2, 8] activation", dict(shape=[3, 2, 8])),
    ],
    hint="dist.send returns only when the peer has posted the matching dist.recv (on gloo and "
         "on NCCL alike), so two neighbours that both send first wait for each other forever, "
         "and so do two that both receive first. Give every pair of neighbours opposite "
         "orders: even stages send first, then receive; odd stages receive first, then send. "
         "Ranks that all waited: a deadlock.",
    ranks_needed=_two_ranks_or_more,
    layout=_all_stages)

