"""Lab 12's checks: the idle unit slots per rank of a schedule (a prediction), and the ZB-H1
order to write (:data:`ZBH1_ORDER`), graded on a live world, one rank per stage.

The learner writes ``my_zbh1_order(stage, num_stages, num_microbatches)``: the list of
``("F", k)``, ``("B", k)`` (input gradient) and ``("W", k)`` (weight gradient) one stage runs.
Each rank of the world checks its list's form, then the world lays every stage's list on the
unit clock (:func:`mpu_lab.perf.pipeline_schedules.simulate`: lists that wait on each other
forever are named before anything runs), then runs it with real tensors: a tiny GPT (the
mirror's ``GPTModel``, whose linear layers hold back their weight-gradient GEMMs under
``delay_wgrad_compute``), real point-to-point messages, the runtime's B and W
(``schedule_runtime.backward_input`` / ``backward_dw``). The verdict compares, in this order:
every gradient of the stage with the same stage run by the mirror's 1F1B loop (an independent
method: autograd's whole backward); the idle slots with ZB-H1's (Qi et al. 2024: ``p - 1`` per
rank at ``m >= p``, 1F1B's ``3(p - 1)``); the micro-batches held (forward run, weight gradient
not yet) with 1F1B's peak, ``min(p, m)``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from mpu_lab.core import parallel_state as ps
from mpu_lab.core.comm import staging
from mpu_lab.core.models.gpt import build_model_chunks
from mpu_lab.core.pipeline_parallel import (
    forward_backward_pipelining_without_interleaving, sync_embedding_weights, unwrap_model)
from mpu_lab.core.pipeline_parallel.action_lists import Action
from mpu_lab.core.pipeline_parallel.microbatch_steps import forward_step
from mpu_lab.core.pipeline_parallel.p2p_communication import ACTIVATION_TAG, GRADIENT_TAG
from mpu_lab.core.pipeline_parallel.schedule_runtime import backward_dw, backward_input
from mpu_lab.core.transformer.transformer_config import TransformerConfig
from mpu_lab.labkit.grader import Case, Exercise, Outcome, compare
from mpu_lab.labkit.notebooks.leaks import declare_answers
from mpu_lab.labkit.pipeline_parallel.exercises import num_microbatches_of, order_text
from mpu_lab.labkit.pipeline_parallel.exercises import order_problem as pipeline_order_problem
from mpu_lab.labkit.verdict import Verdict, as_int, as_int_list, unanswered, verdict
from mpu_lab.labkit.zero_bubble.timelines import peak_in_flight
from mpu_lab.perf.pipeline_schedules import idle_slots, simulate
from mpu_lab.training import initialize

_KINDS = ("F", "B", "W")


def check_idle_slots(answer: Any, schedule: str, p: int, m: int) -> Verdict:
    """Idle unit slots per rank (``F = B = W = 1``): one number (the same on every rank) or a
    list, one per rank."""
    if unanswered(answer, "the idle unit slots: one number (every rank), or one per rank"):
        return Verdict(False)
    expected = idle_slots(schedule, p, m)
    got = as_int_list(answer) if isinstance(answer, (list, tuple)) else as_int(answer)
    if isinstance(got, int):
        got = [got] * p
    return verdict(got == expected,
                   f"{schedule} at p = {p}, m = {m} leaves {expected} idle unit slots per rank.",
                   f"{answer!r} is not it. Hint: count the unit slots each rank works "
                   f"({'F, B and W: 3 per micro-batch' if schedule != '1F1B' else 'F = 1 and BW = 2 per micro-batch'}) "
                   f"and the length of the iteration: the last stage cannot start before p - 1 "
                   f"forwards have passed, and the first stage's last B waits for p - 1 Bs.")


# --------------------------------------------------------------------------- write the order
def order_problem(order: Any, m: int) -> Optional[str]:
    """What makes ``order`` impossible for one stage, or ``None``: lab 11's check with the
    third kind, each ``("F", k)``, ``("B", k)``, ``("W", k)`` once, B after its F, W after its B."""
    return pipeline_order_problem(order, m, kinds=_KINDS)


# the tiny GPT every stage runs: two layers per stage
SEQ, MBS, VOCAB, SEED = 8, 1, 32, 1234


def _config(p: int) -> TransformerConfig:
    return TransformerConfig(num_layers=2 * p, hidden_size=16, num_attention_heads=2)


def _chunk(p: int, device) -> torch.nn.Module:
    torch.manual_seed(SEED)
    (chunk,) = build_model_chunks(_config(p), VOCAB, SEQ)
    chunk = chunk.to(device)
    sync_embedding_weights([chunk])             # the last stage's tied copy (collective)
    return chunk


def _batches(m: int, device) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(m)
    out = []
    for _ in range(m):
        ids = torch.randint(0, VOCAB, (MBS, SEQ + 1),
                            generator=g)    # cpu: a CPU generator, moved below
        out.append({"tokens": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device),
                    "position_ids": torch.arange(SEQ, device=device)})
    return out


def _gpt_step(data_iterator, model):
    batch = next(data_iterator)
    chunk = unwrap_model(model)
    labels = batch["labels"] if chunk.post_process else None
    output = (model(batch["tokens"], batch["position_ids"], labels=labels) if chunk.pre_process
              else model(labels=labels))
    return output, lambda loss: (loss.float().mean(), {"lm loss": loss.detach()})


def run_order(order, chunk, batches) -> None:
    """Run one stage's ``order`` as the action-list runtime runs a list: a receive right before
    the action that needs it, sends started and waited for at the end."""
    p, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    group, device = ps.get_pipeline_model_parallel_group(), initialize.get_device()
    shape = (SEQ, MBS, _config(p).hidden_size)
    sends, inputs, outputs, stores, store = [], {}, {}, {}, []

    def send(tensor, to, tag):
        out = staging.to_backend(tensor.detach().contiguous(), group)[0]
        sends.append((dist.isend(out, dist.get_global_rank(group, to), group=group, tag=tag),
                      out))

    def recv(frm, tag):
        buffer = torch.empty(shape, device=staging.backend_device(device, group))
        dist.irecv(buffer, dist.get_global_rank(group, frm), group=group, tag=tag).wait()
        return staging.from_backend(buffer, device)

    try:
        for kind, k in order:
            if kind == "F":
                inp = None if rank == 0 else recv(rank - 1, ACTIVATION_TAG).requires_grad_(True)
                out = forward_step(_gpt_step, iter([batches[k]]), chunk, len(batches), inp,
                                   store)
                if rank < p - 1:
                    send(out, rank + 1, ACTIVATION_TAG)
                inputs[k], outputs[k] = inp, out
            elif kind == "B":
                grad = None if rank == p - 1 else recv(rank + 1, GRADIENT_TAG)
                stores[k] = []
                input_grad = backward_input(inputs.pop(k), outputs.pop(k), grad, None, stores[k])
                if rank > 0:
                    send(input_grad, rank - 1, GRADIENT_TAG)
            else:
                backward_dw(stores.pop(k))
    finally:
        for work, _ in sends:
            work.wait()


def _gather(obj) -> List[Any]:
    everyone = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(everyone, obj, group=ps.get_pipeline_model_parallel_group())
    return everyone


def run_zbh1_case(learner: Callable, case) -> Outcome:
    """Runs on every rank (one stage each): form, then the lists on the unit clock, then a
    real run against 1F1B's gradients, then the bubble, then the memory (module docstring)."""
    p, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    m = num_microbatches_of(case.params, p)
    where = f"stage {stage} of {p}, m = {m}:"
    error = problem = None
    order: Any = None
    try:
        order = learner(stage, p, m)
        problem = order_problem(order, m)
    except NotImplementedError:
        raise
    except Exception as exc:       # noqa: BLE001 -- re-raised below, after the other stages know
        error, problem = exc, "raised"
    everyone = _gather(None if problem else [(kind, int(k)) for kind, k in order])
    if error is not None:
        raise error
    if problem:
        return Outcome(False, f"the order of {where}", "each of F, B, W once per micro-batch, "
                       "B after its F, W after its B", f"{order!r:.200} ({problem})")
    if any(o is None for o in everyone):     # another stage's list cannot run: it reports
        return Outcome(True)
    lists = {r: [Action(kind, k, 0) for kind, k in o] for r, o in enumerate(everyone)}
    try:
        placed = simulate(lists)
    except ValueError as exc:
        return Outcome(False, f"p = {p}, m = {m}: the stages' lists together",
                       "lists that can all run", f"they wait on each other forever ({exc})")
    device = initialize.get_device()
    batches = _batches(m, device)
    reference = _chunk(p, device)
    forward_backward_pipelining_without_interleaving(
        forward_step_func=_gpt_step, data_iterator=iter(batches), model=reference,
        num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS)
    mine = _chunk(p, device)
    run_order(everyone[stage], mine, batches)
    for (name, want), got in zip(reference.named_parameters(), mine.parameters()):
        outcome = compare(f"{where} the gradient of {name} (vs 1F1B)", want.grad, got.grad)
        if not outcome.ok:
            return outcome
    makespan = max(s.end for slots in placed.values() for s in slots)
    idle = makespan - sum(s.end - s.start for s in placed[stage])
    target = idle_slots("ZBH1", p, m)[stage]
    if idle > target:
        return Outcome(False, f"{where} idle unit slots (F = B = W = 1; 1F1B leaves "
                       f"{idle_slots('1F1B', p, m)[stage]})", f"at most {target}",
                       f"{idle}: {order_text(everyone[stage])}")
    held = int(peak_in_flight(lists, "ZBH1")[stage])
    if held > min(p, m):
        return Outcome(False, f"{where} micro-batches held at once (forward run, W not yet: "
                       f"a W held back keeps its layer inputs and gradients)",
                       f"at most {min(p, m)}, 1F1B's peak", f"{held}: "
                       f"{order_text(everyone[stage])}")
    return Outcome(True)


ZBH1_ORDER = Exercise(
    name="my_zbh1_order",
    run_case=run_zbh1_case,
    cases=[
        Case("m = p", dict(times=1)),
        Case("m = 2p + 1", dict(times=2, plus=1)),
        Case("m = 1", dict(plus=1)),
    ],
    hint="start from 1F1B's order with each W right after its B. The first stage's Bs are the "
         "last of each micro-batch's backward, the last stage's the first: a later stage would "
         "sit idle at the end while the stages before it finish their Bs. Hold back a stage's "
         "first few Ws (how many grows with the stage: the first stage holds none) and run "
         "them at the end, where 1F1B's cool-down idles. Holding back every W delays the last "
         "Bs behind them, and every W held back keeps its micro-batch's layer inputs and "
         "gradients.",
    layout=lambda world_size: (1, world_size),
    module="schedules.py")      # beside lab 11's 1F1B in the learner's package


# --------------------------------------------------------------------------- answers in sight
# The predictions the notebook's check cells ask (p = 4, m = 8): searched for above each
# answer cell by tests/labs/test_no_answer_before_commit.py.
declare_answers([
    ("12", "1F1B idle slots", [idle_slots("1F1B", 4, 8), "9 idle", "3(p - 1) = 9"],
     'check_idle_slots(answer_1f1b, "1F1B"'),
    ("12", "ZB-H1 idle slots", [idle_slots("ZBH1", 4, 8), "3 idle", "p - 1 = 3"],
     'check_idle_slots(answer_zbh1, "ZBH1"'),
])
