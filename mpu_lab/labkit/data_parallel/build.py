"""Lab 04's builds (issue 42): two whole pieces of the learner's own Megatron, each graded on a
live world and, once right, saved into the learner's package for the capstone (lab 18).

* :data:`DDP_BUILD`: the learner's ``DistributedDataParallel(module, data_parallel_group,
  bucket_size, num_micro_batches)`` class with ``zero_grad_buffer()`` and ``finish_grad_sync()``
  (what the capstone calls): it packs the parameters into buckets in reverse order (a bucket
  closes once it holds ``bucket_size`` elements or more, Megatron's rule), hooks every
  parameter's gradient accumulation, starts a bucket's all-reduce asynchronously once all its
  gradients (every micro-batch's) are in, and waits for them in ``finish_grad_sync()``, which
  leaves each parameter's ``.grad`` the average over the data-parallel group. Graded on every
  rank against a dense twin's gradient on the whole global batch, and by the all-reduces it
  issued, seen from outside (:class:`~mpu_lab.labkit.c10d_calls.C10dCalls`): how many, their
  sizes, ``async_op``, and when (how many gradients had arrived then: the harness's own
  hooks).
* :data:`OPTIMIZER_BUILD`: the learner's ``DistributedOptimizer(params, data_parallel_group,
  lr, betas, eps, weight_decay)`` with ``step()`` (ZeRO-1: reduce-scatter the gradients, Adam on
  this rank's shard, all-gather the parameters), graded against ``torch.optim.Adam`` on the
  dense twin over two steps, by its collectives (a reduce-scatter and an all-gather, no
  all-reduce) and by the state it keeps (Adam's m and v for 1/d of the parameters).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

import torch
import torch.distributed as dist

from mpu_lab.core import parallel_state
from mpu_lab.labkit.c10d_calls import C10dCall, C10dCalls
from mpu_lab.labkit.data_parallel.exercises import hook_batches, hook_mlp
from mpu_lab.labkit.grader import Case, Exercise, Outcome, compare
from mpu_lab.training import initialize


def _data_parallel_ranks(world_size: int, tp: int, pp: int):
    if world_size // (tp * pp) < 2:
        return (f"it needs a data-parallel size of 2 or more, and this world has d = "
                f"{world_size} / (tp {tp} x pp {pp}) = {world_size // (tp * pp)}")
    return None


def bucket_sizes(sizes: Sequence[int], bucket_size: int) -> List[int]:
    """Elements per bucket when parameters of ``sizes`` elements (in the order given) are
    packed: a bucket closes once it holds ``bucket_size`` elements or more."""
    out, filled = [], 0
    for n in sizes:
        filled += n
        if filled >= bucket_size:
            out.append(filled)
            filled = 0
    return out + ([filled] if filled else [])


def _padded(n: int, d: int) -> int:
    return -(-n // d) * d


def _close(got: List[torch.Tensor], expected: List[torch.Tensor], rtol: float = 1e-4) -> bool:
    return all(g is not None and g.shape == e.shape and torch.allclose(g, e, rtol=rtol, atol=1e-6)
               for g, e in zip(got, expected))


def _dense_grads(sizes, seed, batches) -> List[torch.Tensor]:
    """The dense twin's gradient of the mean micro-batch loss over ``batches``."""
    model = hook_mlp(sizes, seed).to(initialize.get_device())
    loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in batches)
    (loss / len(batches)).backward()
    return [p.grad for p in model.parameters()]


class _Arrivals:
    """The harness's view of backward: gradients arrived so far per parameter (its own
    post-accumulate hooks), and each all-reduce as it is dispatched (elements, ``async_op``,
    inside backward or not, how many gradients had arrived then)."""

    def __init__(self, params: List[torch.nn.Parameter]):
        self.counts = {id(p): 0 for p in params}
        self.arrived, self.running = 0, False
        self.calls: List[Dict[str, Any]] = []
        self.others: List[str] = []
        self.handles = [p.register_post_accumulate_grad_hook(self._arrive) for p in params]

    def _arrive(self, param) -> None:
        self.counts[id(param)] += 1
        self.arrived += 1

    def note(self, call: C10dCall) -> None:
        if call.what != "all-reduce":
            self.others.append(call.what)
            return
        self.calls.append(dict(numel=sum(t.numel() for t in call.tensors),
                               is_async=call.is_async, in_backward=self.running,
                               arrived=self.arrived, counts=dict(self.counts)))


def _ddp_calls_verdict(log: _Arrivals, params, m: int, d: int, bucket_size: int,
                       where: str) -> Outcome:
    """What the all-reduces of one iteration say, before the values are compared."""
    numels = [p.numel() for p in params]
    want = bucket_sizes(numels[::-1], bucket_size)
    forward = bucket_sizes(numels, bucket_size)
    got = [c["numel"] for c in log.calls]
    what = f"{where} the all-reduces (bucket_size {bucket_size}, {m} micro-batch(es))"
    expected = (f"{len(want)} asynchronous all-reduce(s), one per bucket, of {want} elements "
                f"(the parameters in reverse order)")
    if log.others:
        return Outcome(False, what, expected, f"{', '.join(log.others)} as well")
    if not got:
        return Outcome(False, what, expected, "no all-reduce at all: no bucket was ever sent")
    if len(got) == len(numels) and len(want) < len(numels):
        return Outcome(False, what, expected, f"{len(got)} all-reduces of {got}: one per "
                                              f"parameter, not one per bucket")
    fits = [g in (w, _padded(w, d)) for g, w in zip(got, want)]
    if sorted(got) == sorted(forward) and sorted(forward) != sorted(want):
        return Outcome(False, what, expected, f"{got}: buckets of the parameters in forward "
                                              f"order {forward}")
    if len(got) < len(want) and all(fits):
        return Outcome(False, what, expected, f"{got}: bucket(s) {list(range(len(got), len(want)))}"
                                              f" never sent")
    if len(got) != len(want) or not all(fits):
        return Outcome(False, what, expected, f"{len(got)} all-reduce(s) of {got} elements")
    bucket_params, start = [], 0
    reverse = list(params)[::-1]
    for w in want:                      # the parameters of each bucket, in bucket order
        n, taken = 0, []
        while n < w:
            taken.append(reverse[start])
            n += reverse[start].numel()
            start += 1
        bucket_params.append(taken)
    for i, c in enumerate(log.calls):
        if c["is_async"] is False:
            return Outcome(False, what, expected, f"bucket {i}'s all-reduce with async_op=False:"
                                                  f" backward stood still until it was done")
        have = min(c["counts"][id(p)] for p in bucket_params[i])
        if have < m:
            return Outcome(False, what, expected, f"bucket {i} all-reduced when one of its "
                                                  f"parameters had {have} of its {m} gradient(s)")
    if len(want) > 1 and not any(c["in_backward"] and c["arrived"] < log.arrived
                                 for c in log.calls):
        return Outcome(False, what, "an all-reduce started while backward still computed "
                                    "gradients (overlap)",
                       "every all-reduce started after the last gradient arrived: nothing "
                       "overlapped")
    return Outcome(True)


def _ddp_values_verdict(got, expected, local, world_sum, d, world, names, where) -> Outcome:
    """The averaged gradients against the dense twin's; a wrong one is named by what it is."""
    if _close(got, expected):
        return Outcome(True)
    what = f"{where} the gradients after finish_grad_sync()"
    known = [([e * d for e in expected], "the sum over the group: divide by its size d = "
                                         f"{d}"),
             ([e * d / world for e in expected], f"divided by the world's size {world}, not "
                                                 f"the group's d = {d}"),
             ([w / world for w in world_sum], "averaged over the whole world: use the "
                                              "data-parallel group you were given"),
             ([w / d for w in world_sum], "summed over the whole world: use the data-parallel "
                                          "group you were given"),
             (local, "this rank's own gradients: nothing was averaged into .grad")]
    for values, meaning in known:
        if _close(got, values):
            return Outcome(False, what, "the average over the data-parallel group",
                           f"{meaning}")
    for g, e, name in zip(got, expected, names):
        out = compare(f"{where} the averaged gradient of {name}", e, g)
        if not out.ok:
            return out
    return Outcome(True)


def run_ddp_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank: the learner's DDP around the MLP, ``iterations`` iterations of
    ``micro_batches`` backward passes each (``zero_grad_buffer()`` first, ``finish_grad_sync()``
    last, as the capstone calls them), against the dense twin on the group's whole batch."""
    group = parallel_state.get_data_parallel_group()
    d, me = dist.get_world_size(group=group), dist.get_rank(group=group)
    world = dist.get_world_size()
    t = parallel_state.get_tensor_model_parallel_rank()    # the data differ across groups too
    sizes, m, seed = case.params["sizes"], case.params["micro_batches"], case.params["seed"]
    bucket_size = case.params["bucket_size"]
    where = f"data-parallel rank {me} of {d}:"
    device = initialize.get_device()
    model = hook_mlp(sizes, seed).to(device)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    log = _Arrivals(params)            # registered first: it counts before the learner's hooks
    ddp = learner(model, group, bucket_size=bucket_size, num_micro_batches=m)
    try:
        for it in range(case.params.get("iterations", 1)):
            data = [[(x.to(device), y.to(device)) for x, y in rank]
                    for rank in hook_batches(sizes, d, m, seed + 1 + 1000 * t + 10 * it)]
            expected = _dense_grads(sizes, seed, [b for rank in data for b in rank])
            local = _dense_grads(sizes, seed, data[me])
            world_sum = [g.clone() for g in local]
            for g in world_sum:           # for the verdict only: the world group's sum
                dist.all_reduce(g)
            log.calls, log.others, log.arrived = [], [], 0
            log.counts = dict.fromkeys(log.counts, 0)
            ddp.zero_grad_buffer()
            with C10dCalls(on_call=log.note):
                for x, y in data[me]:
                    log.running = True
                    (torch.nn.functional.mse_loss(model(x), y) / m).backward()
                    log.running = False
                ddp.finish_grad_sync()
            at = f"{where} iteration {it + 1}:" if it else where
            out = _ddp_calls_verdict(log, params, m, d, bucket_size, at)
            if not out.ok:
                return out
            out = _ddp_values_verdict([p.grad for p in params], expected, local, world_sum,
                                      d, world, names, at)
            if not out.ok:
                return out
    finally:
        for h in log.handles:
            h.remove()
    return Outcome(True)


DDP_BUILD = Exercise(
    name="MyDistributedDataParallel",
    run_case=run_ddp_case,
    cases=[
        Case("one bucket, 1 micro-batch", dict(sizes=[6, 8, 4], micro_batches=1,
                                              bucket_size=10_000, seed=1)),
        Case("buckets of about 40 elements, 1 micro-batch",
             dict(sizes=[6, 8, 8, 4], micro_batches=1, bucket_size=40, seed=2)),
        Case("buckets of about 40 elements, 2 micro-batches, 2 iterations",
             dict(sizes=[6, 8, 8, 4], micro_batches=2, bucket_size=40, seed=3, iterations=2)),
        Case("buckets of about 20 elements, 3 micro-batches",
             dict(sizes=[5, 7, 3], micro_batches=3, bucket_size=20, seed=4)),
    ],
    hint="walk the parameters in reverse and close a bucket once it holds bucket_size "
         "elements or more; a bucket is ready when each of its parameters has had one gradient "
         "per micro-batch; start its all-reduce without waiting (what does dist.all_reduce "
         "return with async_op=True?) on the group you were given, and in finish_grad_sync "
         "wait for each, divide by the group's size and put the averages in .grad.",
    ranks_needed=_data_parallel_ranks,
    module="distributed_data_parallel.py",
    saves_as=("DistributedDataParallel",))


# --------------------------------------------------------------------------- the optimizer
def _state_elements(obj: Any, skip: set) -> int:
    """Elements of the tensors ``obj`` keeps (through its attributes, lists, dicts and the
    torch optimizers in it), but not those in ``skip`` (data pointers: the model's
    parameters and gradients) nor a torch optimizer's own parameters and their gradients."""
    tensors, optimizers, visited, stack = [], [], set(), [obj]
    while stack:
        x = stack.pop()
        if id(x) in visited:
            continue
        visited.add(id(x))
        if isinstance(x, torch.Tensor):
            tensors.append(x)
        elif isinstance(x, torch.optim.Optimizer):
            optimizers.append(x)
            stack.extend(x.state.values())
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set)):
            stack.extend(x)
        elif hasattr(x, "__dict__") and not isinstance(x, torch.nn.Module) \
                and not callable(getattr(x, "wait", None)):
            stack.extend(vars(x).values())
    seen = set(skip)
    for o in optimizers:
        for g in o.param_groups:
            seen |= {p.data_ptr() for p in g["params"]}
            seen |= {p.grad.data_ptr() for p in g["params"] if p.grad is not None}
    total = 0
    for x in tensors:
        if x.data_ptr() not in seen:
            seen.add(x.data_ptr())
            total += x.numel()
    return total


def run_optimizer_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank: ``steps`` steps of the learner's optimizer on the MLP (each rank's
    own gradient in ``.grad``) against ``torch.optim.Adam`` on the dense twin with the group's
    average gradient."""
    group = parallel_state.get_data_parallel_group()
    d, me = dist.get_world_size(group=group), dist.get_rank(group=group)
    sizes, seed, lr = case.params["sizes"], case.params["seed"], case.params["lr"]
    where = f"data-parallel rank {me} of {d}:"
    device = initialize.get_device()
    twin, model = hook_mlp(sizes, seed).to(device), hook_mlp(sizes, seed).to(device)
    n = sum(p.numel() for p in model.parameters())
    reference = torch.optim.Adam(twin.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8)
    optimizer = learner(model.parameters(), group, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    for step in range(case.params["steps"]):
        data = [[(x.to(device), y.to(device)) for x, y in rank]
                for rank in hook_batches(sizes, d, 1, seed + 1 + 10 * step)]
        twin.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(twin(x), y) for rank in data for x, y in rank)
        (loss / d).backward()
        reference.step()
        model.zero_grad()
        x, y = data[me][0]
        torch.nn.functional.mse_loss(model(x), y).backward()
        with C10dCalls() as calls:
            optimizer.step()
        at = f"{where} step {step + 1}:"
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            out = compare(f"{at} {name} after the step", q, p)
            if not out.ok:
                return out
        seen = calls.collectives()
        if "reduce-scatter" not in seen or "all-gather" not in seen or "all-reduce" in seen:
            return Outcome(False, f"{at} the collectives called (the values were right)",
                           "a reduce-scatter of the gradients and an all-gather of the "
                           "parameters, no all-reduce", ", ".join(seen) or "none")
    skip = {p.data_ptr() for p in model.parameters()}
    skip |= {p.grad.data_ptr() for p in model.parameters() if p.grad is not None}
    held, shard = _state_elements(optimizer, skip), -(-n // d)
    if held > 3 * shard + d:
        return Outcome(False, f"{where} the state your optimizer keeps ({n} parameters)",
                       f"Adam's m and v (and this rank's main copy) for 1/d of them: at most "
                       f"3 x {shard} = {3 * shard} elements", f"{held} elements")
    return Outcome(True)


OPTIMIZER_BUILD = Exercise(
    name="MyDistributedOptimizer",
    run_case=run_optimizer_case,
    cases=[
        Case("an MLP of 74 parameters, 2 steps", dict(sizes=[6, 8, 2], seed=1, lr=1e-2,
                                                       steps=2)),
        Case("an MLP of 57 parameters (odd: padded at any d), lr 1e-3, 2 steps",
             dict(sizes=[5, 6, 3], seed=2, lr=1e-3, steps=2)),
    ],
    hint="flatten the parameters into one buffer padded to a multiple of d (the data-parallel "
         "group's size); keep Adam's state for your shard only; in step(), reduce-scatter the "
         "flat gradients over the group and divide by d, step your shard, all-gather the "
         "shards and copy them back into the parameters.",
    ranks_needed=_data_parallel_ranks,
    module="distrib_optimizer.py",
    saves_as=("DistributedOptimizer",))
