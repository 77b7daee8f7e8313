"""Lab 04's checks: the optimizer-state bytes per rank with and without the distributed
optimizer (:func:`check_optimizer_state_gb`), and the write-the-code exercise
:data:`DISTRIBUTED_STEP`: the distributed optimizer's step for one flat buffer
(reduce-scatter the gradient, update this rank's shard, all-gather the parameters), run on a
live world and compared on every rank with the plain step (all-reduce the gradient, update
everything)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from mpu_lab.core import comm, parallel_state
from mpu_lab.training import initialize
from mpu_lab.core.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer
from mpu_lab.labkit.c10d_calls import C10dCall, C10dCalls
from mpu_lab.labkit.verdict import Verdict, unanswered, verdict
from mpu_lab.labkit.grader import Case, Exercise, Outcome, compare
from mpu_lab.labkit.notebooks.leaks import declare_answers
from mpu_lab.perf.cost_model import bytes_per_parameter_terms


def _as_number(answer: Any) -> Optional[float]:
    if isinstance(answer, bool):
        return None
    try:
        return float(answer)
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- predictions
def optimizer_state_terms(params_dtype: str = "bf16", grads_dtype: str = "fp32") -> Dict[str, int]:
    """The bytes per parameter that the optimizer keeps, which the distributed optimizer splits
    over the data-parallel ranks: the ``sharded`` terms of Megatron-core's table
    (:func:`mpu_lab.perf.cost_model.bytes_per_parameter_terms`): the fp32 main weight (and the
    fp32 main gradient when the gradients are 16-bit), Adam's m and v. The defaults are
    Megatron's bf16 training (bf16 weights, fp32 gradients)."""
    return bytes_per_parameter_terms(params_dtype, grads_dtype)["sharded"]


def optimizer_state_bytes(num_params: float, d: int, distributed_optimizer: bool,
                          params_dtype: str = "bf16", grads_dtype: str = "fp32") -> float:
    """Bytes of optimizer state per data-parallel rank for ``num_params`` parameters held by
    that rank's model replica (:func:`optimizer_state_terms` per parameter), split over the
    ``d`` ranks by the distributed optimizer."""
    if d < 1 or int(d) != d:
        raise ValueError(f"d must be a whole number >= 1, got {d!r}")
    state = sum(optimizer_state_terms(params_dtype, grads_dtype).values()) * num_params
    return state / d if distributed_optimizer else state


def check_optimizer_state_gb(answer: Any, num_params: float, d: int,
                             distributed_optimizer: bool = True, params_dtype: str = "bf16",
                             grads_dtype: str = "fp32", rtol: float = 0.01) -> Verdict:
    """GB (1e9 bytes) of optimizer state on each data-parallel rank
    (:func:`optimizer_state_bytes`)."""
    if unanswered(answer, "a number of GB"):
        return Verdict(False)
    expected = optimizer_state_bytes(num_params, d, distributed_optimizer, params_dtype,
                                     grads_dtype) / 1e9
    terms = optimizer_state_terms(params_dtype, grads_dtype)
    given = _as_number(answer)
    who = "the distributed optimizer" if distributed_optimizer else "the plain optimizer"
    how = (f"{sum(terms.values())} bytes per parameter ("
           + " + ".join(f"{v} {k}" for k, v in terms.items())
           + f") x {num_params:,.0f} parameters" + (f" / d = {d}" if distributed_optimizer else ""))
    return verdict(given is not None and abs(given - expected) <= rtol * expected,
                    f"{expected:g} GB per rank: {how}.",
                    f"{answer!r} is not it. Hint: which of Megatron's bytes per parameter "
                    f"({params_dtype} weights, {grads_dtype} gradients) belong to the "
                    f"optimizer, and does {who} split them over the {d} data-parallel ranks?")


# --------------------------------------------------------------------------- write the code
# The learner writes ``my_distributed_step(param, grad, lr, group)``: this rank's copy of a
# flat fp32 parameter buffer, its own gradient, a learning rate and the data-parallel group;
# it returns the parameters after one plain-SGD step on the gradient averaged over the group,
# computed the distributed optimizer's way. Graded on every rank against the plain step
# (mpu_lab.core.comm's all-reduce, then the update of every element), and by the collectives it
# called, seen from outside (:mod:`~mpu_lab.labkit.c10d_calls`): a reduce-scatter
# and an all-gather, never an all-reduce.
_REDUCE_SCATTER = "reduce-scatter"
_ALL_GATHER = "all-gather"
def step_inputs(n: int, seed: int, rank: int, device=None):
    """``(param, grad)`` of a case: the same ``n`` parameters on every rank (from ``seed``),
    a gradient that differs per rank (from ``seed`` and the global ``rank``)."""
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen)  # cpu: CPU generator, the same on every device
    grad_gen = torch.Generator().manual_seed(seed * 1000 + 7 * rank + 1)
    grad = torch.randn(n, generator=grad_gen)  # cpu: CPU generator, moved below
    grad = grad * (1.0 + rank)            # ranks differ in size too, so a missed average shows
    return param.to(device), grad.to(device)


def plain_step(param: torch.Tensor, grad: torch.Tensor, lr: float, group) -> torch.Tensor:
    """The reference: the plain data-parallel step. All-reduce the gradient
    (:func:`mpu_lab.core.comm.all_reduce`), divide by the group's size, update every element."""
    mean = comm.all_reduce(grad, group) / dist.get_world_size(group=group)
    return param - lr * mean


def run_distributed_step_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank: the learner's step on this rank's inputs, against the plain step,
    and the collectives it called."""
    group = parallel_state.get_data_parallel_group()
    d = dist.get_world_size(group=group)
    rank = dist.get_rank()
    device = initialize.get_device()
    n, lr, seed = case.params["n"], case.params["lr"], case.params["seed"]
    param, grad = step_inputs(n, seed, rank, device)
    expected = plain_step(param.clone(), grad.clone(), lr, group)
    with C10dCalls() as calls:
        got = learner(param.clone(), grad.clone(), lr, group)
    seen = calls.collectives()
    where = f"data-parallel rank {parallel_state.get_data_parallel_rank()} of {d}:"
    out = compare(f"{where} the updated parameters", expected, got)
    if not out.ok:
        return out
    called = ", ".join(seen) or "none"
    if _REDUCE_SCATTER not in seen or _ALL_GATHER not in seen or "all-reduce" in seen:
        return Outcome(False, f"{where} the collectives called (the values were right)",
                       "a reduce-scatter of the gradient and an all-gather of the parameters, "
                       "no all-reduce", called)
    return Outcome(True)


DISTRIBUTED_STEP = Exercise(
    name="my_distributed_step",
    run_case=run_distributed_step_case,
    cases=[
        Case("8 parameters, lr 0.1", dict(n=8, lr=0.1, seed=1)),
        Case("11 parameters (pad to a multiple of d)", dict(n=11, lr=0.1, seed=2)),
        Case("1 parameter (every other rank's shard is padding)", dict(n=1, lr=0.5, seed=3)),
        Case("37 parameters, lr 0.01", dict(n=37, lr=0.01, seed=4)),
    ],
    hint="pad the gradient with zeros to a multiple of d = dist.get_world_size(group) (the "
         "data-parallel group, not the world), reduce-scatter it over the group and divide by "
         "d: your shard of the average. Update the same shard of the (padded) parameters, "
         "all-gather the shards over the group, and drop the padding.")


# --------------------------------------------------------------------------- the bucket hook
# The learner writes ``my_grad_ready_hook(param, state)``: the hook Megatron's DDP puts on
# every parameter's gradient accumulation. Autograd calls it each time one micro-batch's
# gradient of ``param`` has been added to ``param.main_grad`` (a view into the flat gradient
# buffer, so into a bucket's ``grad_data``). Once every parameter of a bucket has had all its
# micro-batches, the hook starts that bucket's all-reduce asynchronously and leaves the handle
# in ``state.pending``; backward goes on while the bucket is reduced. The grader waits for
# the handles after backward and divides by d, as ``finish_grad_sync`` does.
@dataclasses.dataclass
class BucketState:
    """What the hook sees: the mirror's buckets (``.index``, ``.params``, ``.grad_data``),
    the data-parallel ``group``, ``num_micro_batches``, ``counts`` (param -> gradients added
    this step, 0 at the start: the hook keeps it) and ``pending`` (bucket index -> the handle
    of its started all-reduce: the hook fills it)."""

    buckets: List[Bucket]
    group: Any
    num_micro_batches: int
    counts: Dict[torch.nn.Parameter, int]
    pending: Dict[int, Any]
    _where: Dict[int, int] = dataclasses.field(default_factory=dict)

    def bucket_of(self, param: torch.nn.Parameter) -> Bucket:
        """The bucket that holds ``param``'s gradient."""
        return self.buckets[self._where[id(param)]]


def hook_mlp(sizes: Sequence[int], seed: int) -> torch.nn.Sequential:
    """The exercise's model: Linear, tanh, ..., Linear (fp32), made under ``seed``."""
    torch.manual_seed(seed)
    layers: List[torch.nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def hook_batches(sizes: Sequence[int], d: int, micro_batches: int, seed: int):
    """``[rank][micro-batch] -> (x, y)``: every data-parallel rank's micro-batches (4 samples
    each), the same on every rank, so each can build the whole global batch for the
    reference."""
    gen = torch.Generator().manual_seed(seed)
    cpu = dict(generator=gen, device="cpu")   # cpu: a CPU generator; the grader moves them
    return [[(torch.randn(4, sizes[0], **cpu), torch.randn(4, sizes[-1], **cpu))
             for _ in range(micro_batches)] for _ in range(d)]


class _BucketAllReduces:
    """Every all-reduce while the hook runs, seen from outside (:class:`C10dCalls`): the bucket
    its tensor is (or of which it is a copy: ``mpu_lab.core.comm`` reduces a copy), whether it
    was asynchronous, whether backward was running and how many gradients each of the bucket's
    parameters had then (the harness's own count)."""

    def __init__(self, buckets: List[Bucket], counts: Dict[int, int], running: List[bool]):
        self.buckets, self.counts, self.running = buckets, counts, running
        self.calls: List[Dict[str, Any]] = []

    def _bucket(self, tensor: torch.Tensor):
        """``(bucket, is a copy)``, or ``(None, False)``: the tensor is no bucket's grad_data."""
        for b in self.buckets:
            if tensor.numel() == b.numel and tensor.data_ptr() == b.grad_data.data_ptr():
                return b, False
        for b in self.buckets:
            if tensor.numel() == b.numel and torch.equal(tensor.to(b.grad_data), b.grad_data):
                return b, True
        return None, False

    def note(self, call: C10dCall) -> None:
        """:class:`C10dCalls`'s ``on_call``: runs as the all-reduce is dispatched."""
        if call.what != "all-reduce":
            return
        tensor = call.tensors[0]
        b, copy = self._bucket(tensor)
        self.calls.append(dict(
            bucket=None if b is None else b.index, copy=copy, is_async=call.is_async,
            numel=tensor.numel(), in_backward=self.running[0],
            counts=[] if b is None else [self.counts[id(p)] for p in b.params]))


def _hook_verdict(log: _BucketAllReduces, state: BucketState, m: int, where: str) -> Outcome:
    """What the hook's all-reduces say before the values are compared."""
    expected = (f"one asynchronous all-reduce per bucket, on bucket.grad_data, started during "
                f"backward once all its parameters had their {m} gradient(s), in bucket order "
                f"0..{len(state.buckets) - 1}")
    for c in log.calls:
        if c["bucket"] is None:
            return Outcome(False, f"{where} the all-reduces your hook started", expected,
                           f"an all-reduce of {c['numel']} elements, which is not a bucket's "
                           f"grad_data")
        if c["copy"]:
            return Outcome(False, f"{where} the all-reduces your hook started", expected,
                           f"an all-reduce of a copy of bucket {c['bucket']}'s grad_data (what "
                           f"mpu_lab.core.comm reduces): the sum never reaches the bucket")
        if c["is_async"] is False:
            return Outcome(False, f"{where} the all-reduces your hook started", expected,
                           f"bucket {c['bucket']}'s all-reduce with async_op=False: backward "
                           f"stood still until it was done")
        if min(c["counts"]) < m:
            return Outcome(False, f"{where} the all-reduces your hook started", expected,
                           f"bucket {c['bucket']} started when one of its parameters had "
                           f"{min(c['counts'])} of its {m} gradient(s)")
    started = [c["bucket"] for c in log.calls]
    if len(set(started)) < len(started):
        return Outcome(False, f"{where} the all-reduces your hook started", expected,
                       f"buckets started in the order {started}: one twice")
    missing = [b.index for b in state.buckets if b.index not in state.pending]
    if missing or sorted(state.pending) != sorted(started):
        return Outcome(False, f"{where} the handles in state.pending after backward", expected,
                       f"started {started}, handles for {sorted(state.pending)}: bucket(s) "
                       f"{missing or 'with no all-reduce'} never reduced")
    if started != sorted(started) or not all(c["in_backward"] for c in log.calls):
        return Outcome(False, f"{where} when the all-reduces started", expected,
                       f"order {started}, during backward: "
                       f"{[c['in_backward'] for c in log.calls]}")
    return Outcome(True)


def run_bucket_hook_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank: the MLP's gradients in the mirror's buffer, the learner's hook on
    every parameter, ``micro_batches`` backward passes of this rank's data; then the wait and
    the average. Graded against a dense single-process reference on the whole global batch
    (every rank's micro-batches), and by the all-reduces the hook started."""
    group = parallel_state.get_data_parallel_group()
    d, me = dist.get_world_size(group=group), dist.get_rank(group=group)
    sizes, m, seed = case.params["sizes"], case.params["micro_batches"], case.params["seed"]
    where = f"data-parallel rank {me} of {d}:"
    device = initialize.get_device()
    data = [[(x.to(device), y.to(device)) for x, y in rank]
            for rank in hook_batches(sizes, d, m, seed + 1)]
    reference = hook_mlp(sizes, seed).to(device)
    loss = sum(torch.nn.functional.mse_loss(reference(x), y) for rank in data for x, y in rank)
    (loss / (d * m)).backward()

    model = hook_mlp(sizes, seed).to(device)
    buffer = ParamAndGradBuffer(list(model.parameters()), d, case.params["bucket_size"])
    for p in buffer.params:
        p.grad = p.main_grad                    # autograd accumulates into the buffer
    state = BucketState(buffer.buckets, group, m, {p: 0 for p in buffer.params}, {},
                        {id(p): buffer.param_range(p)[0] for p in buffer.params})
    counts, running = {id(p): 0 for p in buffer.params}, [False]

    def count(param):                           # the harness's own count, before the hook's
        counts[id(param)] += 1
    handles = [p.register_post_accumulate_grad_hook(count) for p in buffer.params]
    handles += [p.register_post_accumulate_grad_hook(lambda p: learner(p, state))
                for p in buffer.params]
    log = _BucketAllReduces(buffer.buckets, counts, running)
    try:
        with C10dCalls(on_call=log.note):
            for x, y in data[me]:
                running[0] = True
                (torch.nn.functional.mse_loss(model(x), y) / m).backward()
                running[0] = False
    finally:
        for h in handles:
            h.remove()
    for index in sorted(state.pending):          # finish_grad_sync: wait, then average
        handle = state.pending[index]
        if hasattr(handle, "wait"):
            handle.wait()
    out = _hook_verdict(log, state, m, where)
    if not out.ok:
        return out
    for b in buffer.buckets:
        b.grad_data.div_(d)
    names = dict((id(p), n) for n, p in model.named_parameters())
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        out = compare(f"{where} the averaged gradient of {names[id(p)]}", p_ref.grad, p.main_grad)
        if not out.ok:
            return out
    return Outcome(True)


BUCKET_HOOK = Exercise(
    name="my_grad_ready_hook",
    run_case=run_bucket_hook_case,
    cases=[
        Case("one bucket, 1 micro-batch", dict(sizes=[6, 8, 4], micro_batches=1,
                                              bucket_size=None, seed=1)),
        Case("a bucket of about 20 elements each, 1 micro-batch",
             dict(sizes=[6, 8, 4], micro_batches=1, bucket_size=20, seed=2)),
        Case("buckets of about 40 elements, 2 micro-batches",
             dict(sizes=[6, 8, 8, 4], micro_batches=2, bucket_size=40, seed=3)),
        Case("one parameter per bucket, 3 micro-batches",
             dict(sizes=[5, 7, 3], micro_batches=3, bucket_size=1, seed=4)),
    ],
    hint="a bucket is ready when each of its parameters has had one gradient per micro-batch, "
         "not before; then its all-reduce must not hold backward up. What does dist.all_reduce "
         "return when asked not to wait?")


# --------------------------------------------------------------------------- answers in sight
# Lab 04's graded answers, computed by the graders above from the arguments the notebook's
# check cells pass (at the stored run's profile, labs/profiles/cpu.yaml, where a cell passes a
# parameter): tests/labs/test_no_answer_before_commit.py searches the notebook for them above
# each answer cell (mpu_lab.labkit.notebooks.leaks).
_STATE_GB = optimizer_state_bytes(1.2e9, 4, distributed_optimizer=True) / 1e9
declare_answers([
    ("04", "optimizer state GB per rank", [_STATE_GB, f"{_STATE_GB:g} GB"],
     "check_optimizer_state_gb("),
])
