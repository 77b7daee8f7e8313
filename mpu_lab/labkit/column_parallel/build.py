"""Lab 06's build: the learner's whole ``ColumnParallelLinear``, graded on a live world and, once
right, saved into their package as ``my_megatron/layers.py:ColumnParallelLinear`` (the capstone,
lab 18, builds its GPT's ``linear_qkv`` and ``linear_fc1`` from it through the layer spec).

The learner's class takes the keyword arguments the mirror's layer specs pass
(``input_size, output_size, bias, gather_output, init_method, skip_bias_add,
sequence_parallel, params_dtype``) and its forward returns ``(output, bias_or_None)``
(Megatron-core's convention). Each case builds it and the mirror's
:class:`~mpu_lab.core.tensor_parallel.ColumnParallelLinear` after the same
``torch.manual_seed``, on every rank of a TP = 2 world (the grader's ``layout``), and compares,
in this order, each with the verdict that names the slip:

* the layer: a ``torch.nn.Module`` whose ``weight`` (and ``bias``) are registered parameters,
  of this rank's shard shape (the wrong split dimension is named), on the rank's device, equal
  (<= 1e-6) to this rank's rows of the master weight ``init_method`` draws (another rank's
  block is named); the bias zero, as Megatron starts it;
* the forward (the biases set to the same non-zero values first): ``(output, bias)``, the
  output equal to the mirror's (a gather not asked for, a missing one, a bias added under
  ``skip_bias_add``, a missing sequence-parallel all-gather are named), the returned bias;
* the collectives the forward issued, counted from outside with
  :class:`~mpu_lab.labkit.c10d_calls.C10dCalls` (torch's ``CommDebugMode``) against the count
  worked out by hand; a reduce-scatter built from an all-reduce and a slice counts as one;
* the backward (``dL/dY`` the same for both): ``x.grad`` (a missing f, which leaves this rank's
  term ``dY_i W_i`` only, is named), the weight's and the bias's gradients, and backward's
  collectives.

A rank moves to the next stage only when every rank passed this one (a MIN all-reduce over the
world), so a rank whose forward was wrong never leaves its peers waiting in backward.

:func:`run_layer_case` is the rank-side engine lab 07's row-parallel build uses too
(:mod:`mpu_lab.labkit.row_parallel.build`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from mpu_lab.core import parallel_state, tensor_parallel
from mpu_lab.labkit.c10d_calls import C10dCalls
from mpu_lab.labkit.grader import Case, Exercise, Outcome, compare, show
from mpu_lab.training import initialize

TOL = 1e-6        # absolute and relative, fp32 (the design's linear-layer tolerance)
INITS = {"xavier_normal_": torch.nn.init.xavier_normal_,
         "normal_(std=0.02)": functools.partial(torch.nn.init.normal_, mean=0.0, std=0.02)}


def two_tp_ranks(world_size: int, tp: int, pp: int) -> Optional[str]:
    """The builds grade at TP = 2: the world's ranks must split into pairs."""
    return None if world_size % 2 == 0 else (f"the builds grade at tensor-parallel size 2, and "
                                             f"{world_size} ranks cannot be split in pairs")


def tp_pairs(world_size: int) -> Tuple[int, int]:
    """The builds' grading layout, ``(tp, pp)``: tensor-parallel pairs, no pipeline (the world
    is regrouped to it for the grading and back after; :func:`two_tp_ranks` checks it fits)."""
    return 2, 1


def on_every_rank(flag: bool) -> bool:
    """True when ``flag`` is true on every rank of the world (a MIN all-reduce)."""
    value = torch.tensor([1 if flag else 0], device=initialize.get_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
    return bool(value.item())


def close(a: Any, b: torch.Tensor) -> bool:
    return (isinstance(a, torch.Tensor) and tuple(a.shape) == tuple(b.shape)
            and torch.allclose(a.detach().float().cpu(), b.detach().float().cpu(),
                               atol=TOL, rtol=TOL))


def counted_text(kinds: Sequence[str]) -> str:
    """``["all-gather", "all-reduce"]`` -> ``"1 all-gather, 1 all-reduce"``; ``"none"``."""
    if not kinds:
        return "none"
    return ", ".join(f"{list(kinds).count(k)} {k}" for k in sorted(set(kinds)))


def same_collectives(got: Sequence[str], expected: Sequence[str]) -> bool:
    """The same collectives, a reduce-scatter made of an all-reduce and a slice (the result is
    the same, t times the bytes) counting as a reduce-scatter."""
    def norm(kinds):
        return sorted("all-reduce" if k == "reduce-scatter" else k for k in kinds)
    return norm(got) == norm(expected)


# --------------------------------------------------------------------------- the layer itself
def _parameter(layer: torch.nn.Module, name: str) -> Optional[torch.nn.Parameter]:
    return dict(layer.named_parameters(recurse=False)).get(name)


def check_built(mine: Any, ref: torch.nn.Module, master: torch.Tensor, dim: int,
                wrong_dim_text: str) -> Outcome:
    """The learner's freshly built layer against the mirror's: a Module, ``weight`` and
    ``bias`` registered, shapes (``wrong_dim_text`` when cut along the other dimension), device,
    the weight's values (this rank's block of ``master`` along ``dim``) and the zero bias."""
    t = parallel_state.get_tensor_model_parallel_world_size()
    r = parallel_state.get_tensor_model_parallel_rank()
    if not isinstance(mine, torch.nn.Module):
        return Outcome(False, "the layer", "a torch.nn.Module", type(mine).__name__)
    weight = _parameter(mine, "weight")
    if weight is None:
        return Outcome(False, "the layer's parameters", "a torch.nn.Parameter named weight "
                       "(Megatron's name: the capstone's model and optimizer look for it)",
                       f"parameters {sorted(dict(mine.named_parameters()))}")
    expected = tuple(ref.weight.shape)
    if tuple(weight.shape) != expected:
        other = list(master.shape)
        other[1 - dim] //= t
        why = (wrong_dim_text if list(weight.shape) == other else
               "the whole master weight: keep this rank's block" if tuple(weight.shape) ==
               tuple(master.shape) else "")
        return Outcome(False, "weight's shape", f"{expected}, this rank's block of W = A^T "
                       f"{tuple(master.shape)} cut along dim {dim}",
                       f"{tuple(weight.shape)}" + (f": {why}" if why else ""))
    if weight.device != ref.weight.device:
        return Outcome(False, "weight's device", f"{ref.weight.device} (the rank's device)",
                       f"{weight.device}: put the parameters on the rank's device "
                       f"(mpu_lab.core.utils.get_device())")
    if not close(weight, ref.weight):
        blocks = master.chunk(t, dim=dim)
        others = [k for k in range(t) if k != r and close(weight, blocks[k])]
        why = (f"block {others[0]} of the master, not block {r}: this rank keeps the block of "
               f"its tensor-parallel rank" if others else
               "not this rank's block of the master init_method draws after the same "
               "torch.manual_seed (the whole [out, in] master on the CPU in fp32, then the "
               "block)")
        return Outcome(False, "weight's values", show(ref.weight), f"{show(weight)}: {why}")
    bias = _parameter(mine, "bias")
    if ref.bias is None:
        if getattr(mine, "bias", None) is not None:
            return Outcome(False, "bias", "None (bias=False)", show(getattr(mine, "bias")))
        return Outcome(True)
    if bias is None:
        return Outcome(False, "the layer's parameters", "a torch.nn.Parameter named bias "
                       "(bias=True)", f"parameters {sorted(dict(mine.named_parameters()))}")
    if tuple(bias.shape) != tuple(ref.bias.shape):
        return Outcome(False, "bias's shape", f"{tuple(ref.bias.shape)}", f"{tuple(bias.shape)}")
    if not close(bias, ref.bias):
        return Outcome(False, "bias's first values", f"{show(ref.bias)} (Megatron starts the "
                       f"bias at zero)", show(bias))
    return Outcome(True)


# --------------------------------------------------------------------------- one case, any layer
def block(full: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    """``full`` itself (``dim`` None), or this tensor-parallel rank's block of it along
    ``dim``."""
    if dim is None:
        return full
    t = parallel_state.get_tensor_model_parallel_world_size()
    return full.chunk(t, dim=dim)[parallel_state.get_tensor_model_parallel_rank()]


def run_layer_case(learner: Callable, case: Case, mirror: type, split_dim: int,
                   layer_kwargs: Dict[str, Any], dims: Dict[str, Optional[int]],
                   collectives: Tuple[List[str], List[str]],
                   diagnose: Callable[..., str], diagnose_grad: Callable[..., str],
                   wrong_dim_text: str) -> Outcome:
    """Runs on every rank: one case of a whole-layer build. ``mirror``: the reference class;
    ``split_dim``: the master weight's dimension it cuts; ``layer_kwargs``: the keyword
    arguments both get (``init_method`` named by ``case.params["init"]``); ``dims``: the
    dimension along which this rank holds a block of the input ``"x"``, of the output
    ``"y"`` and of the bias ``"bias"`` (None: the whole), of tensors drawn whole
    (``case.params["x"]``: the whole input's shape), so every rank of a group holds the same
    gradient of the same loss; ``collectives``: (forward, backward) worked out by hand;
    ``diagnose(got, expected, ref, x)`` and ``diagnose_grad(got, expected, ref, dy)`` name a
    slip in a wrong output or ``x.grad`` ('' when none)."""
    p = case.params
    kwargs = dict(layer_kwargs, init_method=INITS[p["init"]], params_dtype=torch.float32)
    device = initialize.get_device()
    rng = torch.get_rng_state()
    try:
        torch.manual_seed(p["seed"])
        ref = mirror(p["input_size"], p["output_size"], keep_master_weight_for_test=True,
                     **kwargs)
        torch.manual_seed(p["seed"])
        mine = learner(p["input_size"], p["output_size"], **kwargs)
    finally:
        torch.set_rng_state(rng)
    built = check_built(mine, ref, ref.master_weight, split_dim, wrong_dim_text)
    if not on_every_rank(built.ok):
        return built if not built.ok else Outcome(True)

    g = torch.Generator().manual_seed(p["seed"] + 1)       # cpu: the same draws on every rank
    if ref.bias is not None:
        bias = torch.randn(p["output_size"], generator=g)  # cpu: drawn whole, then the block
        with torch.no_grad():
            for layer in (ref, mine):
                layer.bias.copy_(block(bias, dims["bias"]).to(device))
    x = block(torch.randn(*p["x"], generator=g), dims["x"]).to(device)   # cpu: then moved
    x_ref, x_mine = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, bias_ref = ref(x_ref)
    with C10dCalls() as calls:
        got = mine(x_mine)
    seen = _forward_outcome(got, out_ref, bias_ref, diagnose, ref, x)
    if seen.ok and not same_collectives(calls.collectives(), collectives[0]):
        seen = Outcome(False, "the collectives of forward", counted_text(collectives[0]),
                       counted_text(calls.collectives()))
    if seen.ok and not got[0].requires_grad:
        seen = Outcome(False, "the output", "a tensor autograd can differentiate",
                       "no gradient: the output does not depend on x through autograd")
    if not on_every_rank(seen.ok):
        return seen if not seen.ok else Outcome(True)

    t = parallel_state.get_tensor_model_parallel_world_size()
    whole = [n * (t if d == dims["y"] % out_ref.dim() else 1) for d, n in enumerate(out_ref.shape)] \
        if dims["y"] is not None else list(out_ref.shape)
    dy = block(torch.randn(*whole, generator=g), dims["y"]).to(device)   # cpu: then moved
    out_ref.backward(dy)
    with C10dCalls() as calls:
        got[0].backward(dy)
    seen = compare("x.grad", x_ref.grad, x_mine.grad, atol=TOL, rtol=TOL)
    if not seen.ok and isinstance(x_mine.grad, torch.Tensor):
        why = diagnose_grad(x_mine.grad, x_ref.grad, ref, dy)
        seen = Outcome(False, seen.what, seen.expected, seen.got + (f": {why}" if why else ""))
    for name in ("weight", "bias"):
        if not seen.ok or getattr(ref, name) is None:
            continue
        expected, grad = getattr(ref, name).grad, _parameter(mine, name).grad
        if expected is None:        # a bias handed back (skip_bias_add): the caller adds it
            if grad is not None and bool(grad.any()):
                seen = Outcome(False, f"{name}.grad", "None: the output does not use it",
                               show(grad))
            continue
        seen = compare(f"{name}.grad", expected, grad, atol=TOL, rtol=TOL)
    if seen.ok and not same_collectives(calls.collectives(), collectives[1]):
        seen = Outcome(False, "the collectives of backward", counted_text(collectives[1]),
                       counted_text(calls.collectives()))
    return seen


def _forward_outcome(got: Any, out_ref: torch.Tensor, bias_ref: Optional[torch.Tensor],
                     diagnose: Callable[..., str], ref: torch.nn.Module,
                     x: torch.Tensor) -> Outcome:
    """The forward's return: ``(output, bias_or_None)``, the output, then the bias."""
    if not isinstance(got, tuple) or len(got) != 2:
        return Outcome(False, "what forward returns", "(output, bias or None), as Megatron's "
                       "layers return", f"{type(got).__name__} "
                       f"{show(got) if isinstance(got, torch.Tensor) else ''}".strip())
    out, bias = got
    seen = compare("the output", out_ref, out, atol=TOL, rtol=TOL)
    if not seen.ok:
        why = diagnose(out, out_ref, ref, x) if isinstance(out, torch.Tensor) else ""
        return Outcome(False, seen.what, seen.expected, seen.got + (f": {why}" if why else ""))
    if bias_ref is None:
        if bias is not None:
            return Outcome(False, "the bias forward returns", "None (the bias is added "
                           "unless skip_bias_add)", show(bias))
        return Outcome(True)
    if not close(bias, bias_ref):
        return Outcome(False, "the bias forward returns (skip_bias_add=True)",
                       f"{show(bias_ref)}, the bias parameter, not added", show(bias)
                       if isinstance(bias, torch.Tensor) else repr(bias))
    return Outcome(True)


# --------------------------------------------------------------------------- the column build
def _column_diagnosis(got: torch.Tensor, expected: torch.Tensor, ref: torch.nn.Module,
                      x: torch.Tensor) -> str:
    """Name the slip a wrong column-parallel output shows ('' when none matches)."""
    t = parallel_state.get_tensor_model_parallel_world_size()
    shape, want = list(got.shape), list(expected.shape)
    if shape[:-1] == want[:-1] and shape[-1] == want[-1] * t:
        return "the gathered Y: with gather_output=False each rank keeps its block of columns"
    if shape[:-1] == want[:-1] and shape[-1] * t == want[-1]:
        return "this rank's block only: gather_output=True asks for the whole Y"
    if ref.sequence_parallel and shape[0] * t == want[0]:
        return ("this rank's block of the sequence: with sequence_parallel the input is "
                "all-gathered along the sequence (dim 0) first")
    if shape[0] == want[0] * t and shape[-1] * t == want[-1]:
        return "the blocks stacked along dim 0: gather them along the last dimension"
    if ref.bias is not None and got.shape == expected.shape and not ref.gather_output:
        b_i = ref.bias.detach()
        if ref.skip_bias_add and close(got, expected + b_i):
            return ("the bias was added: with skip_bias_add the layer returns it and leaves "
                    "the adding to the caller")
        if not ref.skip_bias_add and close(got + b_i, expected):
            return "the bias is missing: add b_i to this rank's Y_i (unless skip_bias_add)"
    return ""


def _column_grad_diagnosis(got: torch.Tensor, expected: torch.Tensor, ref: torch.nn.Module,
                           dy: torch.Tensor) -> str:
    """A missing f: ``x.grad`` is this rank's term ``dY_i W_i`` alone."""
    if ref.sequence_parallel:
        return ""
    dy_i = dy if dy.shape[-1] == ref.weight.shape[0] else block(dy, -1)
    if close(got, dy_i @ ref.weight.detach()):
        return ("this rank's term dY_i W_i only; the sum over the tensor-parallel group "
                "(f's backward all-reduce) is missing")
    return ""


def run_column_case(learner: Callable, case: Case) -> Outcome:
    """Runs on every rank: one case of the ColumnParallelLinear build (module docstring)."""
    p = case.params
    flags = {k: p[k] for k in ("bias", "gather_output", "skip_bias_add", "sequence_parallel")}
    sp = flags["sequence_parallel"]
    gathers = ["all-gather"] if flags["gather_output"] or sp else []
    return run_layer_case(
        learner, case, tensor_parallel.ColumnParallelLinear, 0, flags,
        {"x": 0 if sp else None, "y": None if flags["gather_output"] else -1, "bias": 0},
        (gathers, ["reduce-scatter"] if sp else ["all-reduce"]),
        _column_diagnosis, _column_grad_diagnosis,
        "cut along dim 1, the input: that is the row-parallel cut; the column-parallel layer "
        "keeps out/t rows of W = A^T [out, in] (dim 0)")


def make_case(name: str, seed: int, x=(4, 2, 8), output_size: int = 6, init="xavier_normal_",
          **flags) -> Case:
    """A case of a layer build: the whole input ``x`` [s, b, in] (input_size = its last
    size), ``output_size``, the init's name in :data:`INITS`, the seed both layers are built
    after, and the layer's flags (the rest at their defaults)."""
    params = dict(bias=True, gather_output=False, skip_bias_add=False, sequence_parallel=False,
                  input_is_parallel=False)
    params.update(flags)
    return Case(name, dict(params, seed=seed, x=list(x), input_size=x[-1],
                           output_size=output_size, init=init))


COLUMN_CASES = [
    make_case("X [4, 2, 8] -> [4, 2, 6], gather_output=False", 1),
    make_case("gather_output=True", 2, gather_output=True),
    make_case("skip_bias_add=True", 3, skip_bias_add=True),
    make_case("sequence_parallel=True", 4, sequence_parallel=True),
    make_case("bias=False, gather_output=True, normal_ init, X [3, 1, 4] -> 4", 5, x=(3, 1, 4),
          output_size=4, bias=False, gather_output=True, init="normal_(std=0.02)"),
]

COLUMN_PARALLEL_LINEAR = Exercise(
    name="MyColumnParallelLinear",
    run_case=run_column_case,
    cases=COLUMN_CASES,
    hint=("__init__: draw the whole master weight [output_size, input_size] with init_method "
          "(on the CPU, in fp32: the same numbers on every rank), keep this tensor-parallel "
          "rank's block of rows as the Parameter weight, and a zero bias of output_size/t. "
          "forward(x): f (copy_to_tensor_model_parallel_region), or with sequence_parallel the "
          "all-gather of the sequence (gather_from_sequence_parallel_region); then X W_i^T, "
          "+ b_i unless skip_bias_add; the all-gather of the columns only when gather_output. "
          "Return (output, bias if skip_bias_add else None)."),
    ranks_needed=two_tp_ranks,
    layout=tp_pairs,
    module="layers.py",
    saves_as=("ColumnParallelLinear",),
)
