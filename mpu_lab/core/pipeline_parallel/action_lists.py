"""The zero-bubble pipeline schedules written as one action list per pipeline rank.

Qi et al. 2024, "Zero Bubble Pipeline Parallelism" (ICLR 2024): the backward of a stage is two
jobs. ``B`` computes the gradient of the stage's input — the previous stage waits for it, so it
is on the critical path — and ``W`` computes the gradients of the stage's weights, which nobody
waits for until the optimizer step. Moving ``W`` into the slots where 1F1B idles shrinks the
bubble (with ``F = B = W`` in time, 1F1B leaves ``3(p - 1)`` idle units per rank, ZB-H1
``p - 1``; ZB-V ``p - 1`` units of half a stage once ``m >= 2p - 1``).

An action is ``(kind, microbatch, chunk)``: ``kind`` is ``"F"`` (forward), ``"B"`` (input
gradient) or ``"W"`` (weight gradient); ``chunk`` is the model chunk of this rank (0, or 0 / 1
in a V). Why lists and a small runtime (:mod:`~mpu_lab.core.pipeline_parallel.schedule_runtime`)
rather than Megatron's loops: 1F1B has three phases and one rule per phase, which loops say
well; ZB-V has five phases, two chunks whose messages run in opposite directions, and ``W``s
that slide between them. Written as loops, the order would hide among the sends and receives.
As a list, the order is data a reader (and a test) can print, simulate and compare with torch's
own (``torch.distributed.pipelining``'s ``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``), and one runtime executes every list: it receives what an action
needs just before it, and sends what it produced without waiting.

* :func:`zbh1_actions` — ZB-H1, the paper's handcrafted schedule 1 (§3.1): 1F1B's warm-up and
  steady state, with rank ``r`` holding back its first ``r`` weight gradients and doing them at
  the end, where 1F1B's cool-down leaves the rank idle. Peak activations as 1F1B (``p - r``
  micro-batches on rank ``r``).
* :func:`zbv_actions` — ZB-V (§6): two chunks per rank in a V. Stage ``r`` is chunk 0 of rank
  ``r`` and stage ``2p - 1 - r`` its chunk 1, so micro-batches go down the ranks through chunk 0
  and back up through chunk 1; the first and the last stage (embedding and loss) are both on
  rank 0.
* :func:`dualpipev_actions` — DualPipeV (DeepSeek-V3's DualPipe, Liu et al. 2024 §3.2.1, folded
  into the same V on one stream of micro-batches; torch's ``ScheduleDualPipeV``): in its steady
  state each step pairs one micro-batch's forward on one chunk with another's whole backward
  (``BW``: B and W together) on the other, so that on a GPU the pair's communication hides
  behind the other's compute. Here the pair is two actions, run one after the other (as
  torch's runtime runs an overlapped pair without a custom overlap function); needs
  ``m >= 2p``.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple

# The schedules written as action lists, by torch's names (ZBH1: the paper's ZB-H1), and how
# their stages lie on the ranks: "loop" one chunk per rank, "v" two chunks in a V.
ACTION_LIST_SCHEDULES = ("ZBH1", "ZBVZeroBubble", "DualPipeV")
STAGE_LAYOUT = {"ZBH1": "loop", "ZBVZeroBubble": "v", "DualPipeV": "v"}
CHUNKS_PER_RANK = {"ZBH1": 1, "ZBVZeroBubble": 2, "DualPipeV": 2}


class Action(NamedTuple):
    """One unit of work on a rank: ``kind`` ``"F"``, ``"B"``, ``"W"`` or ``"BW"`` (B and W at
    once), micro-batch, chunk."""
    kind: str
    microbatch: int
    chunk: int


def stage_of(chunk: int, pipeline_rank: int, pipeline_size: int, layout: str = "loop") -> int:
    """The pipeline stage that ``chunk`` of ``pipeline_rank`` runs: ``chunk * p + rank`` in a
    loop (Megatron's virtual stages), ``rank`` / ``2p - 1 - rank`` in a V."""
    if layout == "v":
        return pipeline_rank if chunk == 0 else 2 * pipeline_size - 1 - pipeline_rank
    return chunk * pipeline_size + pipeline_rank


def rank_and_chunk_of(stage: int, pipeline_size: int, layout: str = "loop"):
    """Inverse of :func:`stage_of`: ``(pipeline_rank, chunk)`` holding ``stage``."""
    if layout == "v":
        return (stage, 0) if stage < pipeline_size else (2 * pipeline_size - 1 - stage, 1)
    return stage % pipeline_size, stage // pipeline_size


def zbh1_actions(pipeline_size: int, pipeline_rank: int, num_microbatches: int) -> List[Action]:
    """ZB-H1 on one rank (one chunk): warm-up forwards, then ``F B`` pairs with a ``W`` after
    each once ``r`` weight gradients are held back, then the cool-down ``B``s (each with a
    ``W``), then the ``r`` held-back ``W``s."""
    p, r, m = pipeline_size, pipeline_rank, num_microbatches
    warmup = min(p - r - 1, m)              # as 1F1B: enough to fill the stages after this one
    actions = [Action("F", i, 0) for i in range(warmup)]
    next_w = 0

    def backward(i: int) -> None:
        nonlocal next_w
        actions.append(Action("B", i, 0))
        if i >= r:                           # the first r weight gradients wait for the end
            actions.append(Action("W", next_w, 0))
            next_w += 1

    # Steady state: the forward of micro-batch i + warmup, then the backward of i.
    for i in range(m - warmup):
        actions.append(Action("F", i + warmup, 0))
        backward(i)
    # Cool-down: the backwards left.
    for i in range(m - warmup, m):
        backward(i)
    # The held-back weight gradients fill the slots where 1F1B's cool-down idles.
    actions.extend(Action("W", i, 0) for i in range(next_w, m))
    return actions


def zbv_actions(pipeline_size: int, pipeline_rank: int, num_microbatches: int) -> List[Action]:
    """ZB-V on one rank (chunks 0 and 1 in a V), Qi et al. 2024 §6; torch's
    ``ScheduleZBVZeroBubble`` builds the same pattern. Written for ``n = max(m, 2p - 1)``
    micro-batches, the full pattern; the actions of the micro-batches ``>= m`` are then left
    out, which keeps every dependency in order."""
    p, r, m = pipeline_size, pipeline_rank, num_microbatches
    n = max(m, 2 * p - 1)
    actions: List[Action] = []
    f = [0, 0]          # next forward, per chunk
    b = [0, 0]          # next input gradient, per chunk
    w = [0, 0]          # next weight gradient, per chunk

    def do(kind: str, chunk: int, counter: List[int]) -> None:
        actions.append(Action(kind, counter[chunk], chunk))
        counter[chunk] += 1

    # 1. Forwards of chunk 0 until the first micro-batch reaches this rank's chunk 1: the V's
    #    turn is p - 1 - r stages below, and back up again.
    for _ in range(2 * (p - r) - 1):
        do("F", 0, f)
    # 2. The first micro-batches come back up: one chunk-1 forward, one chunk-0 forward.
    for _ in range(r):
        do("F", 1, f)
        do("F", 0, f)
    # 3. The first backwards start at chunk 1 (the loss is on rank 0's chunk 1); W at once.
    for _ in range(p - r):
        do("F", 1, f)
        do("B", 1, b)
        do("W", 1, w)
    # 4. Steady state: F B W on chunk 0, then on chunk 1.
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            do("F", 0, f)
        do("B", 0, b)
        do("W", 0, w)
        do("F", 1, f)
        do("B", 1, b)
        do("W", 1, w)
    # 5. Cool-down: the input gradients first (they are on the critical path), the weight
    #    gradients where the rank would otherwise wait.
    for _ in range(r):
        do("B", 0, b)
        do("B", 1, b)
    for _ in range(p - r):
        do("B", 0, b)
        do("W", 0, w)
    while w[1] < b[1]:
        do("W", 1, w)
    while w[0] < b[0]:
        do("W", 0, w)
    assert f == b == w == [n, n], (f, b, w)
    return [a for a in actions if a.microbatch < m]


def dualpipev_actions(pipeline_size: int, pipeline_rank: int,
                      num_microbatches: int) -> List[Action]:
    """DualPipeV on one rank (chunks 0 and 1 in a V), the eight steps of torch's
    ``ScheduleDualPipeV`` (after DeepSeek's ``DualPipeV``). A pair "F on one chunk + BW on the
    other" is the overlapped step; ``B`` alone leaves its ``W`` queued for a later slot."""
    p, r, m = pipeline_size, pipeline_rank, num_microbatches
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs num_microbatches >= 2 x pipeline size = {2 * p}, "
                         f"got {m}")
    actions: List[Action] = []
    f, b = [0, 0], [0, 0]                    # next forward / backward, per chunk
    queued: List[Action] = []                # W of each B run alone, oldest first

    def forward(chunk: int) -> None:
        actions.append(Action("F", f[chunk], chunk))
        f[chunk] += 1

    def backward(chunk: int, split: bool) -> None:
        actions.append(Action("B" if split else "BW", b[chunk], chunk))
        if split:
            queued.append(Action("W", b[chunk], chunk))
        b[chunk] += 1

    def weight() -> None:
        if queued:
            actions.append(queued.pop(0))

    for _ in range(2 * (p - r - 1)):         # 1. chunk-0 forwards down the V
        forward(0)
    for _ in range(r + 1):                   # 2. the first micro-batches turn: F0 F1
        forward(0)
        forward(1)
    for _ in range(p - r - 1):               # 3. the first backwards, split: B1 W1 F1
        backward(1, split=True)
        weight()
        forward(1)
    for i in range(m - 2 * p + r + 1):       # 4. steady state: the overlapped pairs
        forward(0)                           #    F0 + BW1 (the last rank's first: not paired)
        backward(1, split=False)
        forward(1)                           #    F1 + BW0
        backward(0, split=False)
    for _ in range(p - r - 1):               # 5. no forwards of chunk 0 left: BW1, F1 + BW0
        backward(1, split=False)
        forward(1)
        backward(0, split=False)
    split = False
    for i in range(r + 1):                   # 6. B1 B0, split from half-way (zero bubble)
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        backward(1, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        backward(0, split)
    for _ in range(p - r - 1):               # 7. W0 B0
        weight()
        backward(0, split)
    for _ in range(r + 1):                   # 8. the weight gradients left
        weight()
    while queued:
        weight()
    assert f == b == [m, m], (f, b)
    return actions


_GENERATORS = {"ZBH1": zbh1_actions, "ZBVZeroBubble": zbv_actions, "DualPipeV": dualpipev_actions}


def rank_actions(schedule: str, pipeline_size: int, pipeline_rank: int,
                 num_microbatches: int) -> List[Action]:
    """The action list of ``pipeline_rank`` for ``schedule`` (one of
    :data:`ACTION_LIST_SCHEDULES`)."""
    if schedule not in _GENERATORS:
        raise ValueError(f"no action list for schedule {schedule!r}; the schedules written as "
                         f"action lists are {list(ACTION_LIST_SCHEDULES)}")
    if pipeline_size < 1 or not 0 <= pipeline_rank < pipeline_size or num_microbatches < 1:
        raise ValueError(f"{schedule}: pipeline size {pipeline_size}, rank {pipeline_rank}, "
                         f"{num_microbatches} micro-batches: need size >= 1, 0 <= rank < size, "
                         f"micro-batches >= 1")
    return _GENERATORS[schedule](pipeline_size, pipeline_rank, num_microbatches)


def pipeline_actions(schedule: str, pipeline_size: int,
                     num_microbatches: int) -> Dict[int, List[Action]]:
    """Every rank's action list: ``{rank: [Action, ...]}``."""
    return {r: rank_actions(schedule, pipeline_size, r, num_microbatches)
            for r in range(pipeline_size)}
