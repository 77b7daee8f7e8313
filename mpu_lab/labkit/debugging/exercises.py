"""Lab 17's checks: name the cause of a broken job from its diagnosis (:func:`check_cause`), the
rank to look at first (:func:`check_culprit`), the jobs as the learner meets them (numbered,
their fault hidden in the launcher's report until the learner has named the cause:
:func:`print_jobs`, :func:`job_result`, :func:`print_report`, then :func:`reveal`), and the
write-the-code exercise
:data:`EXCHANGE`: one pipeline stage's blocking sends and receives with its neighbours, in an
order that cannot deadlock, run with real point-to-point messages on a live world."""
from __future__ import annotations

import contextlib
import io
import re
import string
import types
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state
from mpu_lab.labkit.verdict import Verdict, as_int, unanswered, verdict
from mpu_lab.labkit.grader import Case, Exercise, Outcome, compare, show
from mpu_lab.labkit.debugging.broken_jobs import FOREGROUND, NOT_RUN, lab_jobs, wrap_lines
from mpu_lab.labkit.notebooks import leaks
from mpu_lab.labkit.debugging.tools import overflow_demo
from mpu_lab.labkit.debugging.readings import READINGS
from mpu_lab.training.faults import FAULT_KINDS
from mpu_lab.megatron_reference import runtime as megatron_core


# --------------------------------------------------------------------------- name the cause
def suspects() -> Dict[str, str]:
    """The list of causes the learner picks from: ``{letter: cause}``, one per fault kind of
    :data:`mpu_lab.training.faults.FAULT_KINDS`, ordered by the cause's text (so the letters
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
        print(wrap_lines(f"{letter}. {cause}").replace("\n    ", "\n   "))


def check_cause(answer: Any, kind: str) -> Verdict:
    """The letter (see :func:`print_suspects`) of the cause behind the fault ``kind`` (a kind
    of :data:`~mpu_lab.training.faults.FAULT_KINDS`, or a job's ``KIND:RANK[:ITERATION]`` as
    ``run.fault`` gives it, so a notebook need not name the fault)."""
    kind = str(kind).split(":")[0]
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


# --------------------------------------------------------------------------- the jobs, unnamed
# The learner reads each job's report before naming its cause, so the lab calls the jobs by
# number and hides what would name the fault: the --inject-fault flag and the injected frame's
# file and function (faults.py's functions are named after their faults). reveal() shows both.
_FAULT_FLAG = re.compile(r"--inject-fault [\w:.-]+")
_FAULT_FRAME = re.compile(r"faults(\.py(?::\d+)?,? in )\w+")
# The fault the lab runs on the playground's ranks rather than as a job (the last numbered one).
PLAYGROUND_FAULT = "fp16-overflow:1"


def masked(text: str) -> str:
    """``text`` with the fault's name hidden: ``--inject-fault ?``, and the injected frame's
    file and function as ``<hidden>.py, in <hidden>`` (a label that said "fault" there would
    name the rank the exercises ask for)."""
    return _FAULT_FRAME.sub(r"<hidden>\1<hidden>", _FAULT_FLAG.sub("--inject-fault ?", text))


def job_names(jobs) -> List[str]:
    """The lab's jobs in the order the lab takes them (``jobs``: a
    :class:`~mpu_lab.labkit.debugging.broken_jobs.BrokenJobs`); job ``k`` is ``job_names(jobs)[k - 1]``."""
    return list(jobs.jobs)


def _name(jobs, number: int) -> str:
    names = job_names(jobs)
    if not 1 <= number <= len(names):
        raise ValueError(f"there is no job {number}: the jobs are 1 to {len(names)}")
    return names[number - 1]


def print_jobs(jobs) -> None:
    """The jobs by number: ranks and flags, the injected fault left out."""
    print("each job: launch/train_gpt.py --inject-fault ? (the fault hidden), and")
    for k, name in enumerate(job_names(jobs), start=1):
        job = jobs.jobs[name]
        how = "  (you start this one yourself)" if name in FOREGROUND else ""
        print(wrap_lines(f"job {k}  {job.nproc} ranks  " + " ".join(job.flags) + how))


def lab_job(jobs, number: int):
    """Job ``number``'s :class:`~mpu_lab.labkit.debugging.broken_jobs.BrokenJob` (to start it yourself)."""
    return jobs.jobs[_name(jobs, number)]


def job_result(jobs, number: int):
    """What job ``number`` did (waiting for it if it has not ended)."""
    return jobs.result(_name(jobs, number))


def _printed(show: Callable[[], None]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        show()
    return out.getvalue()


def print_report(run, part: str = "show") -> None:
    """The launcher's report of a broken job, ``run.show()`` without the command (``part="show"``;
    :func:`print_jobs` lists the jobs) or ``run.diagnosis()`` (``part="diagnosis"``), with the
    fault's name hidden (:func:`masked`) and lines cut at 100 characters."""
    if part not in ("show", "diagnosis"):
        raise ValueError(f"part must be 'show' or 'diagnosis', got {part!r}")
    show = (lambda: run.show(command=False)) if part == "show" else run.diagnosis
    print(wrap_lines(masked(_printed(show))))


def run_playground_job(world) -> List[Dict[str, Any]]:
    """The last job, run on the playground's ranks (:data:`PLAYGROUND_FAULT`): each rank's one
    step side by side (:func:`mpu_lab.labkit.debugging.tools.overflow_demo`)."""
    return overflow_demo(world, bad_rank=int(PLAYGROUND_FAULT.split(":")[1]))


def reveal(fault: str, run=None) -> None:
    """After the learner has named the cause: the fault (``--inject-fault`` as given), what it
    does, what the lab's job shows of it, and, for a job, the launcher's own likely cause."""
    kind = str(fault).split(":")[0]
    print(wrap_lines(f"it was --inject-fault {fault}: {FAULT_KINDS[kind]['what']}"))
    if kind in READINGS:
        print(wrap_lines(READINGS[kind]))
    if run is not None:
        run.likely_cause()


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
    device = initialize.get_device()
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
         "on NCCL alike). Take one pair of neighbours: while one of them sends, what must the "
         "other be doing? Then look for something about a stage's number that can tell each "
         "of two neighbours which part to play, for any number of stages. Ranks that all "
         "waited: a deadlock.",
    ranks_needed=_two_ranks_or_more,
    layout=_all_stages)



# --------------------------------------------------------------------------- after the attempt
# Megatron-core's own order, read from its code by running it: _p2p_ops (pipeline_parallel/
# p2p_communication.py) run as a copy whose globals name a recorder as torch.distributed, next to
# the learner's my_exchange run the same way (its dist.send/recv recorded, nothing sent).
P2P_OPS_URL = ("https://github.com/NVIDIA/Megatron-LM/blob/core_v0.19.2/megatron/core/"
               "pipeline_parallel/p2p_communication.py#L55")


class _CallRecorder:
    """Stands in for ``torch.distributed`` while a function's point-to-point calls are
    recorded: each send or receive is noted as ``send>peer`` / ``recv<peer`` and returns at
    once (a receive leaves its buffer as it was)."""

    def __init__(self):
        self.calls: List[str] = []

    def send(self, tensor, dst, *args, **kwargs):
        self.calls.append(f"send>{dst}")

    def recv(self, tensor, src=None, *args, **kwargs):
        self.calls.append(f"recv<{src}")
        return src

    def isend(self, tensor, dst, *args, **kwargs):
        self.send(tensor, dst)
        return types.SimpleNamespace(wait=lambda *a, **k: True, is_completed=lambda: True)

    def irecv(self, tensor, src=None, *args, **kwargs):
        self.recv(tensor, src)
        return types.SimpleNamespace(wait=lambda *a, **k: True, is_completed=lambda: True)

    def P2POp(self, op, tensor, peer, *args, **kwargs):
        return (op, tensor, peer)

    def batch_isend_irecv(self, ops):
        return [op(tensor, peer) for op, tensor, peer in ops]

    def __getattr__(self, name):
        raise AttributeError(f"dist.{name}: this check records only send, recv, isend, irecv "
                             f"and batch_isend_irecv")


def learner_calls(fn: Callable, stage: int, num_stages: int) -> List[str]:
    """The point-to-point calls ``fn(stage, num_stages, mine)`` makes, in order, with its
    ``dist`` replaced by a recorder (no message is sent: any order runs)."""
    recorder = _CallRecorder()
    recorded = types.FunctionType(fn.__code__, dict(fn.__globals__, dist=recorder, torch=torch),
                                  fn.__name__, fn.__defaults__, fn.__closure__)
    recorded(stage, num_stages, torch.zeros(1))   # cpu: recorded calls only, nothing is sent
    return recorder.calls


def megatron_calls(stage: int, num_stages: int) -> List[str]:
    """The point-to-point calls Megatron-core's ``_p2p_ops`` posts on pipeline stage ``stage``
    of ``num_stages`` (>= 3) when it sends to and receives from both neighbours that exist,
    in the order it posts them (isend / irecv recorded, nothing sent)."""
    if num_stages < 3:
        raise ValueError(f"num_stages must be >= 3 (at 2 stages Megatron-core also picks a "
                         f"second process group), got {num_stages}")
    with megatron_core.without_cuda_runtime_notice(), warnings.catch_warnings():
        warnings.simplefilter("ignore")     # Transformer Engine / Apex absent: expected here
        from megatron.core.pipeline_parallel import p2p_communication   # optional: only here
    recorder = _CallRecorder()
    group = types.SimpleNamespace(rank=lambda: stage, size=lambda: num_stages)
    prev = torch.zeros(1) if stage > 0 else None   # cpu: recorded calls only, nothing is sent
    after = torch.zeros(1) if stage < num_stages - 1 else None   # cpu: as prev
    # Its own copy of _p2p_ops, whose ``torch.distributed`` is the recorder (torch itself is
    # left alone, as in learner_calls).
    fn = p2p_communication._p2p_ops
    recorded = types.FunctionType(fn.__code__, dict(fn.__globals__, torch=types.SimpleNamespace(
        distributed=recorder)), fn.__name__, fn.__defaults__, fn.__closure__)
    recorded.__kwdefaults__ = fn.__kwdefaults__
    recorded(tensor_send_prev=prev, tensor_recv_prev=prev, tensor_send_next=after,
             tensor_recv_next=after, group=group, prev_pipeline_rank=stage - 1,
             next_pipeline_rank=stage + 1)
    return recorder.calls


def compare_with_megatron(fn: Callable, num_stages: int = 4) -> Optional[Dict[int, Tuple]]:
    """Once the learner has written ``my_exchange``: its calls on each of ``num_stages`` stages
    next to Megatron-core's (:func:`megatron_calls`), printed as a table. Returns
    ``{stage: (yours, megatron's)}``, or None when there is nothing to compare yet (the stub)
    or megatron-core cannot be imported here (the reason is printed)."""
    try:
        yours = {s: learner_calls(fn, s, num_stages) for s in range(num_stages)}
    except NotImplementedError:
        print(f"No answer yet: {fn.__name__} still raises NotImplementedError.\nWrite it and "
              f"grade it first; then this cell shows your order next to Megatron-core's.")
        return None
    except Exception as exc:   # noqa: BLE001 -- the learner's code: say what stopped it
        print(f"Could not record {fn.__name__}'s calls: {type(exc).__name__}: {exc}")
        return None
    reason = megatron_core.missing()
    if reason is not None:
        print(f"{reason}\nMegatron-core's order is in _p2p_ops: {P2P_OPS_URL}")
        return None
    theirs = {s: megatron_calls(s, num_stages) for s in range(num_stages)}
    width = max(len("  ".join(c)) for c in yours.values()) + 2
    print(f"{num_stages} stages, each stage's calls in order (send>k: to stage k; recv<k: from "
          f"stage k)")
    print(f"{'stage':<7}{'yours':<{width}}Megatron-core's _p2p_ops")
    for s in range(num_stages):
        print(f"{s:<7}{'  '.join(yours[s]):<{width}}{'  '.join(theirs[s])}")
    print("Megatron-core posts non-blocking isend / irecv and then waits on them all, and "
          "still keeps an order by the parity of the stage's rank in its pipeline group: an "
          "even stage posts its send to the next stage before its receive from the previous "
          "one, an odd stage the receive first. So on both ends of every link each send meets "
          "its receive at the same position; NCCL runs one communicator's point-to-point calls "
          "in the order they were posted, so with NCCL the order matters even for non-blocking "
          "calls.")
    return {s: (yours[s], theirs[s]) for s in range(num_stages)}


# --------------------------------------------------------------------------- answers
# What lab 17's graded questions answer, for the leak check (mpu_lab.labkit.notebooks.leaks):
# each job's fault (job k is the k-th of lab_jobs that runs as a job), its letter in quotes and
# its --inject-fault flag; the culprit, the fault's rank. The lab asks for the cause of jobs
# 1, 2, 3, 4, 6, then 5 and 7 in Going further, then of the playground's fault.
def _lab_answers():
    faults = [job.fault for name, job in lab_jobs(4).items() if name not in NOT_RUN]
    asked = [faults[k - 1] for k in (1, 2, 3, 4, 6, 5, 7)] + [PLAYGROUND_FAULT]
    causes = [("17", f"cause {i}: {fault.split(':')[0]}",
               [letter_of(fault.split(":")[0]), f"inject-fault {fault.split(':')[0]}"],
               "check_cause(", i) for i, fault in enumerate(asked)]
    culprits = [("17", f"culprit of job {k}", [int(faults[k - 1].split(":")[1])],
                 "check_culprit(", i) for i, k in enumerate((1, 5))]
    return causes + culprits


leaks.declare_answers(_lab_answers())
