"""Idle unit slots per pipeline rank for every schedule, with ``F = B = W = 1`` (Qi et al. 2024,
"Zero Bubble Pipeline Parallelism", §2-3: 1F1B leaves ``3(p - 1)`` idle slots on every rank,
ZB-H1 ``p - 1``, ZB-V ``p - 1`` once ``m >= 2p - 1``). A unit slot is one chunk's forward: with
two chunks per rank (Interleaved1F1B at its default, ZB-V) a slot holds half a stage's layers,
so the same count of idle slots is half the time.

Each rank's actions come from what the runtime executes: for ``ZBH1`` / ``ZBVZeroBubble`` the
mirror's action lists (:mod:`mpu_lab.core.pipeline_parallel.action_lists`, the lists
:mod:`~mpu_lab.core.pipeline_parallel.schedule_runtime` runs), for ``GPipe`` / ``1F1B`` /
``Interleaved1F1B`` the planner's order (:func:`mpu_lab.perf.pipeline_order.schedule_order`,
held equal to what Megatron's loops run by ``tests/pipeline_parallel/test_pipeline_mp.py``).
A schedule without the split runs its backward as one action ``BW`` of 2 slots.

:func:`simulate` replays the lists with their dependencies — ``F`` of stage ``s`` after ``F``
of ``s - 1`` for the same micro-batch, ``B`` after ``B`` of ``s + 1`` (after the same stage's
``F`` on the last stage), ``W`` after the same stage's ``B``, and each rank in its own order —
starting every action as early as they allow (messages take no time). The makespan is the
last busy slot + 1; a rank's idle slots are the makespan minus its busy slots.

:func:`torch_actions` reads torch's own orders (``torch.distributed.pipelining``'s
``ScheduleInterleavedZeroBubble`` with one stage per rank, ``ScheduleZBVZeroBubble``) without a
process group, as a second method.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Sequence

from torch.distributed.pipelining import schedules as torch_schedules

from mpu_lab.core.pipeline_parallel.action_lists import (
    ACTION_LIST_SCHEDULES, STAGE_LAYOUT, Action, pipeline_actions, stage_of)
from mpu_lab.perf.pipeline_order import schedule_order

# torch's names where torch has the schedule; ZBH1 for the paper's handcrafted schedule 1.
IDLE_SLOT_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBH1", "ZBVZeroBubble")
DURATION = {"F": 1, "B": 1, "W": 1, "BW": 2}


class Slot(NamedTuple):
    """An action placed in time: it runs in unit slots ``[start, start + duration)``."""
    action: Action
    start: int
    end: int


def schedule_actions(schedule: str, pp: int, num_microbatches: int,
                     num_model_chunks: int = 2) -> Dict[int, List[Action]]:
    """``{rank: [Action, ...]}`` the runtime executes for ``schedule``; the loops' backwards
    (GPipe, 1F1B, Interleaved1F1B) as ``BW``. ``num_model_chunks`` is used by
    ``Interleaved1F1B`` only."""
    if schedule not in IDLE_SLOT_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; idle_slots knows {list(IDLE_SLOT_SCHEDULES)}"
                         f" (DualPipeV's overlapped F+B pairs are not unit slots)")
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be a positive integer, got {pp!r}")
    minimum = {"Interleaved1F1B": pp}.get(schedule, 1)
    if not isinstance(num_microbatches, int) or num_microbatches < minimum:
        raise ValueError(f"{schedule} at pp={pp} needs num_microbatches >= {minimum}, got "
                         f"{num_microbatches!r}")
    if schedule in ACTION_LIST_SCHEDULES:
        return pipeline_actions(schedule, pp, num_microbatches)
    v = num_model_chunks if schedule == "Interleaved1F1B" else 1
    if schedule == "Interleaved1F1B" and (v < 2 or num_microbatches % pp):
        raise ValueError(f"Interleaved1F1B needs num_model_chunks >= 2 (got {v}) and "
                         f"num_microbatches divisible by pp={pp} (got {num_microbatches})")
    return {r: [Action("BW" if op.kind == "B" else "F", op.microbatch, op.chunk)
                for op in schedule_order(schedule, pp, r, num_microbatches, v)]
            for r in range(pp)}


def simulate(actions: Dict[int, Sequence[Action]], layout: str = "loop",
             duration: Dict[str, int] = DURATION) -> Dict[int, List[Slot]]:
    """Start every action as early as its dependencies and its rank's order allow (see the
    module docstring). ``layout``: ``"loop"`` (chunk ``k`` of rank ``r`` is stage ``k·p + r``)
    or ``"v"``. Raises ``ValueError`` when the lists wait on each other forever."""
    p = len(actions)
    num_stages = p * (1 + max((a.chunk for acts in actions.values() for a in acts), default=0))
    done: Dict[tuple, int] = {}                # (kind, stage, microbatch) -> end slot
    clock = {r: 0 for r in actions}
    cursor = {r: 0 for r in actions}
    placed: Dict[int, List[Slot]] = {r: [] for r in actions}

    def needs(a: Action, stage: int):
        if a.kind == "F":
            return [("F", stage - 1, a.microbatch)] if stage > 0 else []
        if a.kind in ("B", "BW"):
            if stage == num_stages - 1:
                return [("F", stage, a.microbatch)]
            return [("B", stage + 1, a.microbatch)]
        return [("B", stage, a.microbatch)]            # W

    progress = True
    while progress:
        progress = False
        for r in sorted(actions):
            while cursor[r] < len(actions[r]):
                a = actions[r][cursor[r]]
                stage = stage_of(a.chunk, r, p, layout)
                deps = needs(a, stage)
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                end = start + duration[a.kind]
                placed[r].append(Slot(a, start, end))
                done[("B" if a.kind == "BW" else a.kind, stage, a.microbatch)] = end
                clock[r], cursor[r], progress = end, cursor[r] + 1, True
    stuck = {r: actions[r][cursor[r]] for r in actions if cursor[r] < len(actions[r])}
    if stuck:
        raise ValueError(f"the action lists wait on each other forever; next actions: {stuck}")
    return placed


def idle_from_slots(placed: Dict[int, List[Slot]]) -> List[int]:
    """Makespan (last busy slot + 1) minus each rank's busy slots, in rank order."""
    makespan = max((s.end for slots in placed.values() for s in slots), default=0)
    return [makespan - sum(s.end - s.start for s in placed[r]) for r in sorted(placed)]


def idle_slots(schedule: str, pp: int, num_microbatches: int, *,
               num_model_chunks: int = 2) -> List[int]:
    """Idle unit slots of each pipeline rank (index = rank) under ``schedule``, with
    ``F = B = W = 1`` and an unsplit backward ``BW = 2``.

    ``schedule``: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``, ``"ZBH1"`` or
    ``"ZBVZeroBubble"``. ``Interleaved1F1B`` runs ``num_model_chunks`` chunks per rank
    (default 2, Megatron's ``--num-layers-per-virtual-pipeline-stage`` = L / (2p)) and needs
    ``num_microbatches`` divisible by ``pp``. ``DualPipeV`` is refused: its overlapped F+B
    pairs are not unit slots (played one after the other, ``simulate`` of its list gives ZB-V's
    ``p - 1``; the overlap is what it adds on a GPU).

    >>> idle_slots("1F1B", 4, 8)
    [9, 9, 9, 9]
    >>> idle_slots("ZBH1", 4, 8)
    [3, 3, 3, 3]
    """
    actions = schedule_actions(schedule, pp, num_microbatches, num_model_chunks)
    return idle_from_slots(simulate(actions, STAGE_LAYOUT.get(schedule, "loop")))


# --------------------------------------------------------------------------- torch's own orders
def torch_actions(schedule: str, pp: int, num_microbatches: int) -> Dict[int, List[Action]]:
    """torch's action lists for ``"ZBH1"`` (``ScheduleInterleavedZeroBubble`` with one stage
    per rank), ``"ZBVZeroBubble"`` (``ScheduleZBVZeroBubble``) or ``"DualPipeV"``
    (``ScheduleDualPipeV``; an overlapped pair as its two actions, forward first), read without
    a process group: the class is made with ``__new__``, given the attributes its order needs,
    and asked for each rank's ``_calculate_single_rank_operations`` (torch's ``None`` = an idle
    slot, left out here; a stage index becomes this rank's chunk)."""
    kinds = {"F": "F", "I": "B", "W": "W", "B": "BW"}
    classes = {"ZBH1": (torch_schedules.ScheduleInterleavedZeroBubble, 1),
               "ZBVZeroBubble": (torch_schedules.ScheduleZBVZeroBubble, 2),
               "DualPipeV": (torch_schedules.ScheduleDualPipeV, 2)}
    if schedule not in classes:
        raise ValueError(f"torch_actions reads {list(classes)}, not {schedule!r}")
    cls, local = classes[schedule]
    sched = cls.__new__(cls)
    sched.pp_group_size, sched._n_microbatches = pp, num_microbatches
    sched.n_local_stages, sched.num_stages = local, local * pp
    sched.number_of_rounds = max(1, num_microbatches // pp)
    sched.microbatches_per_round = num_microbatches // sched.number_of_rounds
    out = {}
    for r in range(pp):
        acts = []
        for action in sched._calculate_single_rank_operations(r):
            for a in (action.sub_actions or ()) if action is not None and \
                    action.computation_type.value == "OVERLAP_F_B" else (action,):
                if a is None:
                    continue
                stage, kind = a.stage_index, kinds[a.computation_type.value]
                chunk = 0 if stage == r else 1 if local == 2 else stage // pp
                acts.append(Action(kind, a.microbatch_index, chunk))
        out[r] = acts
    return out
