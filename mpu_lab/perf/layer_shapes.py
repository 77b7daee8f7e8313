"""What the labs show about a real forward pass: the lecture's shape table, measured on a
:class:`~mpu_lab.core.transformer.transformer_layer.TransformerLayer` (Megatron-core's
``core/transformer/transformer_layer.py``); the lab's own instrument, with no Megatron
counterpart.

* :func:`shape_table` — the lecture's table (Q, K, V, Score, Z, Out, A, A', x') for given
  ``B, L, D, n_H, d_tp``, read off the live tensors of one ``TransformerLayer`` forward on this
  rank, from outside the blocks (:func:`layer_shapes`: forward hooks on their linear layers,
  and a ``TorchFunctionMode`` for the tensors inside the attention that no submodule returns).

It runs inside a rank whose groups are initialised (a ``torchrun`` worker such as
``launch/inspect_gpt.py``); at ``d_tp = 1`` also in the notebook's own process
(:func:`mpu_lab.training.initialize.init_single_process`). The per-layer collective counts are
measured from outside the model: :mod:`mpu_lab.perf.comm_counts`.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from mpu_lab.training import initialize
from mpu_lab.core import parallel_state
from mpu_lab.core.transformer.transformer_layer import TransformerConfig, TransformerLayer

Shapes = Dict[str, Tuple[tuple, tuple]]     # name -> (shape, the meaning of each dimension)


class _InsideAttention(TorchFunctionMode):
    """Notes the attention's tensors that no submodule returns: Q, K, V (the first
    ``torch.split``, of ``linear_qkv``'s output into heads), Score (the softmax) and Z_i (the
    product of the scores with V)."""

    def __init__(self, note: Callable[[str, torch.Tensor, tuple], None]):
        super().__init__()
        self.note, self.scores = note, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.split:
            for name, tensor in zip("QKV", out):                       # each [s, b, n, H]
                self.note(name, tensor, ("L", "B", "n", "H"))
        elif func is torch.softmax:
            self.scores = out
            self.note("Score", out, ("B", "n", "L", "L"))              # [b, n, s, s]
        elif func is torch.matmul and self.scores is not None and args[0] is self.scores:
            self.note("Z_i", out, ("B", "n", "L", "H"))                # [b, n, s, H]
        return out


def layer_shapes(layer: TransformerLayer, x: torch.Tensor) -> Shapes:
    """One forward of ``layer`` on ``x`` (``[L, B, D]``, explicit attention), with the shape of
    each tensor of the lecture's table noted from outside; the first tensor of a name wins."""
    shapes: Shapes = {}

    def note(name, tensor, dims):
        shapes.setdefault(name, (tuple(tensor.shape), dims))

    attention, mlp = layer.self_attention, layer.mlp
    hooks = [
        attention.linear_proj.register_forward_pre_hook(
            lambda _, args: note("Z", args[0], ("L", "B", "D/t"))),
        attention.linear_proj.register_forward_hook(
            lambda _, args, out: note("Out", out[0], ("L", "B", "D"))),
        mlp.linear_fc1.register_forward_hook(lambda _, args, out: note("A", out[0], ("L", "B", "F/t"))),
        mlp.linear_fc2.register_forward_pre_hook(lambda _, args: note("A'", args[0], ("L", "B", "F/t"))),
        mlp.linear_fc2.register_forward_hook(lambda _, args, out: note("x'", out[0], ("L", "B", "D"))),
    ]
    try:
        with _InsideAttention(note):
            layer(x)
    finally:
        for hook in hooks:
            hook.remove()
    return shapes


def _batch_first(shape, dims, drop=()):
    """A recorded shape in the lecture's order: ``(B, L, product of the other dimensions)``;
    dimensions named in ``drop`` (e.g. the head count ``n``) are left out of the product."""
    b = l = None
    rest = 1
    for d, size in zip(dims, shape):
        if d == "B" and b is None:
            b = size
        elif d == "L" and l is None:
            l = size
        elif d not in drop:
            rest *= size
    return (b, l, rest)


def lecture_shapes(B: int, L: int, D: int, n_H: int, d_tp: int = 1,
                   ffn: Optional[int] = None) -> dict:
    """The lecture's table for one rank, ``{name: (shape, how many per rank)}``: the shapes of
    Q, K, V, Q_i, K_i, V_i, Score_i, Z_i, Z, Out, A, A', x' at tensor-parallel size ``d_tp``
    (the second table; ``d_tp = 1`` gives the dense one). ``ffn`` defaults to 4D."""
    F = 4 * D if ffn is None else ffn
    H, n = D // n_H, n_H // d_tp
    return {"Q": ((B, L, D // d_tp), 1), "K": ((B, L, D // d_tp), 1), "V": ((B, L, D // d_tp), 1),
            "Q_i": ((B, L, H), n), "K_i": ((B, L, H), n), "V_i": ((B, L, H), n),
            "Score_i": ((B, L, L), n), "Z_i": ((B, L, H), n), "Z": ((B, L, D // d_tp), 1),
            "Out": ((B, L, D), 1), "A": ((B, L, F // d_tp), 1), "A'": ((B, L, F // d_tp), 1),
            "x'": ((B, L, D), 1)}


def shape_table(batch_size: int = 2, seq_length: int = 8, hidden_size: int = 16,
                num_attention_heads: int = 4, tensor_model_parallel_size: Optional[int] = None,
                activation: str = "relu", ffn_hidden_size: Optional[int] = None) -> List[dict]:
    """The lecture's shape table for one transformer layer on this rank, measured.

    Runs one ``TransformerLayer`` forward (explicit attention, so the ``L x L`` scores
    exist) on ``x`` of ``[L, B, D]`` under the current tensor-parallel group, whose size must
    be ``tensor_model_parallel_size`` (``d_tp``; default: the current size). Each row:
    ``name``, ``computation``, ``lecture`` (the symbolic output shape), ``shape`` (measured,
    in the lecture's ``B x L x ...`` order), ``expected`` (the lecture's shape with the numbers
    put in), ``per_rank`` (how many such tensors this rank holds: ``n_H/d_tp`` for per-head
    rows) and ``live`` (the tensor's own shape and dimension names, sequence-first).
    """
    if not parallel_state.model_parallel_is_initialized():
        if tensor_model_parallel_size not in (None, 1):
            raise RuntimeError(
                f"shape_table at d_tp={tensor_model_parallel_size} needs "
                f"{tensor_model_parallel_size} ranks: run it in a torchrun worker "
                f"(mpu_lab.launcher.run('inspect_gpt.py', ['--tp', '{tensor_model_parallel_size}'"
                f"], nproc={tensor_model_parallel_size})) or call it with d_tp=1 here")
        initialize.init_single_process()
    t = parallel_state.get_tensor_model_parallel_world_size()
    if tensor_model_parallel_size is not None and tensor_model_parallel_size != t:
        raise ValueError(f"tensor_model_parallel_size {tensor_model_parallel_size} differs from "
                         f"the initialised tensor-parallel group size {t}")
    config = TransformerConfig(num_layers=1, hidden_size=hidden_size,
                               num_attention_heads=num_attention_heads,
                               ffn_hidden_size=ffn_hidden_size, activation=activation,
                               attention_impl="explicit")
    config.check(t)
    device = initialize.get_device()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        layer = TransformerLayer(config).eval()
        x = torch.randn(seq_length, batch_size, hidden_size, device=device)   # [L, B, D]
        with torch.no_grad():
            rec = layer_shapes(layer, x)

    B, L, D, nH = batch_size, seq_length, hidden_size, num_attention_heads
    F = config.ffn_hidden_size
    ffn = "4D" if F == 4 * D else "F"
    act = activation
    rows = []

    lecture_table = lecture_shapes(B, L, D, nH, t, F)   # the expectations: one source

    def add(name, computation, lecture, key, per_head=False):
        shape, dims = rec[key]
        expected, per_rank = lecture_table[name]
        measured = _batch_first(shape, dims, drop=("n",) if per_head else ())
        rows.append(dict(name=name, computation=computation, lecture=lecture, shape=measured,
                         expected=expected, per_rank=per_rank,
                         live=dict(shape=shape, dims=dims)))

    add("Q", "Q = x W^Q", "B x L x D/d_tp", "Q")
    add("K", "K = x W^K", "B x L x D/d_tp", "K")
    add("V", "V = x W^V", "B x L x D/d_tp", "V")
    add("Q_i", "[Q_1..Q_{n_H/d_tp}] = Partition_-1(Q)", "B x L x H", "Q", True)
    add("K_i", "[K_1..K_{n_H/d_tp}] = Partition_-1(K)", "B x L x H", "K", True)
    add("V_i", "[V_1..V_{n_H/d_tp}] = Partition_-1(V)", "B x L x H", "V", True)
    add("Score_i", "Score_i = softmax(Q_i K_i^T / sqrt(H))", "B x L x L", "Score", True)
    add("Z_i", "Z_i = Score_i V_i", "B x L x H", "Z_i", True)
    add("Z", "Z = Merge_-1([Z_1..Z_{n_H/d_tp}])", "B x L x D/d_tp", "Z")
    add("Out", "Out = Z W^O, then AllReduce(Out)", "B x L x D", "Out")
    add("A", "A = Out W^1", f"B x L x {ffn}/d_tp", "A")
    add("A'", f"A' = {act}(A)", f"B x L x {ffn}/d_tp", "A'")
    add("x'", "x' = A' W^2, then AllReduce(x')", "B x L x D", "x'")
    return rows


def format_shape_table(rows: List[dict]) -> str:
    """The table as aligned text (deterministic: safe in compared notebook outputs)."""
    header = ("tensor", "computation", "lecture", "measured", "per rank")
    body = [(r["name"], r["computation"], r["lecture"], " x ".join(map(str, r["shape"])),
             str(r["per_rank"])) for r in rows]
    widths = [max(len(x[i]) for x in [header] + body) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
