"""Lab 10's lessons: context parallelism (CP) measured on a live world, and the worked examples.

The mirror (:mod:`mpu_lab.core.context_parallel`) holds Megatron's algorithm and nothing else; what
the lab shows about it is measured here, from outside:

* :func:`activation_memory_rows` (runs on every rank): the activations one transformer layer
  keeps for backward, measured with autograd's saved-tensor hooks
  (:class:`mpu_lab.perf.saved_activations.SavedTensors`) at several sequence lengths, without
  CP and with it, next to the formula (:func:`mpu_lab.perf.saved_activations.mpu_lab_terms`
  at ``s/cp``);
* :func:`ring_schedule`, :func:`running_lse`: the ring step by step, block pair by block pair
  (the mirror's :func:`~mpu_lab.core.context_parallel.ring_attention.block_pair`), and the running
  log-sum-exp of a rank's queries, folded with the mirror's merge in one process;
* :func:`causal_work`, :func:`attention_flops` (runs on every rank): the causal work of a
  contiguous split and of Megatron's zig-zag layout, counted by hand and measured with torch's
  ``FlopCounterMode``;
* :func:`attention_messages` (runs on every rank), :func:`bytes_rows`: what one attention's
  forward and backward send for each ``comm_type``, counted by torch's ``CommDebugMode``
  (:class:`mpu_lab.perf.comm_counts.CollectiveLog`), against the cost model's formulas
  (:func:`mpu_lab.perf.cost_model.cp_comm_bytes_per_layer`).

Functions that run on the ranks take the CP group from :mod:`mpu_lab.core.parallel_state`
(:func:`use_context_parallel` sets it up on a playground world).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from mpu_lab.core import context_parallel, parallel_state
from mpu_lab.training import initialize
from mpu_lab.core.context_parallel.block_attention import block_forward, merge
from mpu_lab.core.context_parallel.ring_attention import block_pair
from mpu_lab.core.transformer import TransformerConfig
from mpu_lab.core.transformer.transformer_layer import TransformerLayer
from mpu_lab.perf.saved_activations import SavedTensors, mpu_lab_terms
from mpu_lab.perf.comm_counts import CollectiveLog
from mpu_lab.perf.cost_model import cp_comm_bytes_per_layer

LAYOUTS = ("contiguous", "zig-zag")


# --------------------------------------------------------------------------- groups
def use_context_parallel(cp: int) -> int:
    """Runs on every rank: Megatron's groups with context-parallel size ``cp`` (t = p = 1), so
    ``parallel_state.get_context_parallel_group()`` is the CP group. Returns this rank's CP
    rank."""
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    return parallel_state.get_context_parallel_rank()


def positions(seq_length: int, cp_rank: int, cp: int, layout: str) -> List[int]:
    """The sequence positions CP rank ``cp_rank`` holds: ``"contiguous"`` (slice ``cp_rank`` of
    ``cp``) or ``"zig-zag"`` (Megatron's chunks ``r`` and ``2cp-1-r`` of ``2cp``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zig-zag":
        return context_parallel.positions_on_rank(seq_length, cp_rank, cp)
    if seq_length % cp:
        raise ValueError(f"seq_length {seq_length} is not divisible by cp = {cp}")
    size = seq_length // cp
    return list(range(cp_rank * size, (cp_rank + 1) * size))


# --------------------------------------------------------------------------- §1 memory
def layer_activation_bytes(s: int, b: int, h: int, a: int, seed: int = 0) -> int:
    """Runs on every rank of the CP group: bytes one ``TransformerLayer`` (fp32, SDPA, dropout
    0) keeps for backward on this rank, its input the rank's ``[s/cp, b, h]`` tokens."""
    cp = parallel_state.get_context_parallel_world_size()
    config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=a,
                               context_parallel_size=cp, attention_impl="sdpa")
    torch.manual_seed(seed)
    layer = TransformerLayer(config).to(initialize.get_device())
    x = torch.randn(s // cp, b, h, device=initialize.get_device(), requires_grad=True)
    with SavedTensors(exclude=layer.parameters()) as saved:
        layer(x)
    return saved.bytes


def formula_bytes(s: int, b: int, h: int, a: int, cp: int) -> int:
    """This package's layer terms (fp32, SDPA, no dropout) at ``s/cp`` tokens: what
    :func:`layer_activation_bytes` should find on each of ``cp`` ranks."""
    return int(sum(v for _, _, v in mpu_lab_terms(s // cp, b, h, a, attention="sdpa")))


def activation_memory_rows(seqs: Sequence[int], b: int, h: int, a: int, cp: int) -> List[dict]:
    """Runs on every rank: for each ``s``, the bytes measured without CP (the whole sequence on
    this rank) and with CP of size ``cp``, and the formula for each. Leaves the CP groups of
    size ``cp`` in place."""
    rows = []
    for s in seqs:
        use_context_parallel(1)
        alone = layer_activation_bytes(s, b, h, a)
        use_context_parallel(cp)
        split = layer_activation_bytes(s, b, h, a)
        rows.append(dict(s=s, cp1=alone, cp1_formula=formula_bytes(s, b, h, a, 1), cp=split,
                         cp_formula=formula_bytes(s, b, h, a, cp)))
    return rows


def format_memory_rows(rows: List[dict], cp: int) -> str:
    """The table of :func:`activation_memory_rows` (one rank's), in MiB to 3 decimals."""
    mib = 2 ** 20
    lines = [f"{'s':>6} {'cp=1 measured':>14} {'formula':>9} {f'cp={cp} measured':>14} "
             f"{'formula':>9} {'ratio':>6}"]
    for r in rows:
        lines.append(f"{r['s']:>6} {r['cp1'] / mib:>14.3f} {r['cp1_formula'] / mib:>9.3f} "
                     f"{r['cp'] / mib:>14.3f} {r['cp_formula'] / mib:>9.3f} "
                     f"{r['cp1'] / r['cp']:>6.2f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- §2 the ring
def pair_kind(rows: slice, cols: slice, diagonal: bool, chunk: int) -> str:
    """A block pair of :func:`~mpu_lab.core.context_parallel.ring_attention.block_pair` in words."""
    if diagonal:
        return "own block, causal mask"
    if rows.start == 0 and rows.stop == 2 * chunk and cols.stop == chunk:
        return "all queries x front chunk"
    if rows.start == chunk:
        return "back chunk x all keys"
    return "all queries x all keys"


def ring_schedule(cp: int, seq_length: int) -> List[List[dict]]:
    """``[rank][step]``: the K/V block rank ``rank`` holds at ring step ``step`` (from CP rank
    ``(rank - step) mod cp``), the key and query positions it computes, the pairs the causal
    mask removes inside them, and the pair's kind, straight from the mirror's ``block_pair``."""
    chunk = seq_length // (2 * cp)
    out = []
    for rank in range(cp):
        mine = context_parallel.positions_on_rank(seq_length, rank, cp)
        steps = []
        for step in range(cp):
            kv_rank = (rank - step) % cp
            theirs = context_parallel.positions_on_rank(seq_length, kv_rank, cp)
            rows, cols, diagonal = block_pair(kv_rank, rank, True, chunk)
            qs, ks = mine[rows], theirs[cols]
            pairs = [(q, k) for q in qs for k in ks]
            kept = [(q, k) for q, k in pairs if k <= q]
            steps.append(dict(step=step, kv_rank=kv_rank, held=theirs, queries=qs, keys=ks,
                              computed=kept, masked=len(pairs) - len(kept),
                              kind=pair_kind(rows, cols, diagonal, chunk)))
        out.append(steps)
    return out


def format_ring_schedule(schedule: List[List[dict]]) -> str:
    """One line per rank and step: the block held, what is computed, pairs kept and masked."""
    lines = []
    for rank, steps in enumerate(schedule):
        for st in steps:
            lines.append(f"rank {rank} step {st['step']}: holds K/V of rank {st['kv_rank']} "
                         f"{_span(st['held'])}: {st['kind']:<26} {len(st['computed']):>3} "
                         f"pairs kept, {st['masked']:>3} masked")
    return "\n".join(lines)


def _span(pos: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 12, 13]`` -> ``"0-3,12-13"``."""
    parts, start = [], pos[0]
    for prev, cur in zip(pos, list(pos[1:]) + [None]):
        if cur != prev + 1:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = cur
    return ",".join(parts)


def attention_inputs(seq_length: int, b: int, n: int, d: int, seed: int, scale_q: float = 1.0,
                     device=None):
    """The whole sequence's ``[s, b, n, d]`` q, k, v in natural order, the same on every rank
    (a CPU generator seeded with ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(seq_length, b, n, d, generator=gen, device="cpu")  # cpu: a CPU generator
               for _ in range(3))
    return (q * scale_q).to(device), k.to(device), v.to(device)


def dense_lse(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``[b, n, s]`` log-sum-exp of every query over the keys at or before it (natural order)."""
    scores = torch.einsum("qbnd,kbnd->bnqk", q, k) * scale
    future = torch.ones(q.size(0), k.size(0), dtype=torch.bool, device=q.device).triu(1)
    return torch.logsumexp(scores.masked_fill(future, float("-inf")), dim=-1)


def running_lse(seq_length: int, cp: int, rank: int, d: int = 4, seed: int = 0) -> dict:
    """The ring of CP rank ``rank``, run in this process with the mirror's pieces: after each
    step, the running log-sum-exp of its queries (one head, one sequence), and the dense
    log-sum-exp it must end at. Returns ``positions``, ``steps`` (one list per step) and
    ``dense``."""
    q, k, v = attention_inputs(seq_length, 1, 1, d, seed)
    scale = d ** -0.5
    chunk = seq_length // (2 * cp)
    mine = context_parallel.positions_on_rank(seq_length, rank, cp)
    out = lse = None
    steps = []
    for step in range(cp):
        kv_rank = (rank - step) % cp
        theirs = context_parallel.positions_on_rank(seq_length, kv_rank, cp)
        rows, cols, diagonal = block_pair(kv_rank, rank, True, chunk)
        block_out, block_lse = block_forward(q[mine][rows], k[theirs][cols], v[theirs][cols],
                                             diagonal, scale)
        if out is None:
            out, lse = block_out, block_lse
        else:
            out[rows], lse[..., rows] = merge(out[rows], lse[..., rows], block_out, block_lse)
        steps.append(lse[0, 0].tolist())
    dense = dense_lse(q, k, scale)[0, 0, mine].tolist()
    return dict(positions=mine, steps=steps, dense=dense)


def format_running_lse(trace: dict) -> str:
    """:func:`running_lse` as a table: one row per query position, one column per step."""
    n = len(trace["steps"])
    lines = [f"{'query':>5} " + " ".join(f"{f'step {i}':>7}" for i in range(n)) + f" {'dense':>7}"]
    for j, pos in enumerate(trace["positions"]):
        lines.append(f"{pos:>5} " + " ".join(f"{st[j]:>7.3f}" for st in trace["steps"])
                     + f" {trace['dense'][j]:>7.3f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- §3 load balance
def causal_work(seq_length: int, cp: int, layout: str) -> List[int]:
    """Per CP rank, the (query, key) pairs the causal mask keeps for its queries: a query at
    position ``p`` sees ``p + 1`` keys."""
    return [sum(p + 1 for p in positions(seq_length, r, cp, layout)) for r in range(cp)]


def contiguous_causal_attention(q, k, v, cp_rank: int, cp: int, scale: float):
    """Causal attention of slice ``cp_rank`` of ``cp`` (a contiguous split) from the whole
    sequence's q, k, v, block by block as a ring would: the slices of the earlier ranks whole,
    its own under the mask, the later ones skipped (every key is in their future)."""
    size = q.size(0) // cp
    mine = slice(cp_rank * size, (cp_rank + 1) * size)
    out = lse = None
    for j in range(cp_rank + 1):
        theirs = slice(j * size, (j + 1) * size)
        block = block_forward(q[mine], k[theirs], v[theirs], j == cp_rank, scale)
        out, lse = block if out is None else merge(out, lse, *block)
    return out


def attention_flops(seq_length: int, b: int, n: int, d: int, seed: int = 0) -> dict:
    """Runs on every rank of the CP group: the FLOPs of this rank's causal attention forward,
    counted by ``FlopCounterMode``, with a contiguous split and with the mirror's ring in the
    zig-zag layout; and whether each output equals the dense attention at its positions."""
    group = parallel_state.get_context_parallel_group()
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v = attention_inputs(seq_length, b, n, d, seed, device=initialize.get_device())
    scale = d ** -0.5
    dense = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True).permute(2, 0, 1, 3)
    out = {}
    with FlopCounterMode(display=False) as naive:
        got = contiguous_causal_attention(q, k, v, rank, cp, scale)
    size = seq_length // cp
    out["contiguous"] = naive.get_total_flops()
    ok = torch.allclose(got, dense[rank * size:(rank + 1) * size], atol=1e-5)
    mine = context_parallel.positions_on_rank(seq_length, rank, cp)
    with FlopCounterMode(display=False) as zigzag:
        got = context_parallel.attention(q[mine], k[mine], v[mine], comm_type="p2p")
    out["zig-zag"] = zigzag.get_total_flops()
    out["equal to dense"] = ok and torch.allclose(got, dense[mine], atol=1e-5)
    return out


def format_work(seq_length: int, cp: int, measured: Optional[List[dict]] = None) -> str:
    """Per rank and layout: the causal pairs (by hand), and the FLOPs measured when given."""
    lines = [f"s = {seq_length}, cp = {cp}"]
    for layout in LAYOUTS:
        work = causal_work(seq_length, cp, layout)
        line = f"{layout:>10}: pairs per rank {work}, max/mean {max(work) * cp / sum(work):.2f}"
        if measured:
            flops = [m[layout] for m in measured]
            line += (f";\n{'':>12}measured FLOPs per rank {flops}, max/mean "
                     f"{max(flops) * cp / sum(flops):.2f}")
        lines.append(line)
    return "\n".join(lines)


# --------------------------------------------------------------------------- §4 bytes
def sent_bytes(kind: str, input_bytes: int, cp: int) -> float:
    """Bytes a rank puts on the wire for one message or collective whose input on this rank is
    ``input_bytes`` (a ring algorithm for the collectives, nccl-tests' accounting): a send
    sends it, a receive nothing; an all-gather passes ``cp - 1`` blocks of its input size; a
    reduce-scatter and an all-to-all send ``(cp - 1)/cp`` of their input."""
    factors = {"send": 1, "recv": 0, "all_gather": cp - 1, "reduce_scatter": (cp - 1) / cp,
               "all_to_all": (cp - 1) / cp}
    if kind not in factors:
        raise ValueError(f"no byte count for {kind!r}; known: {sorted(factors)}")
    return input_bytes * factors[kind]


def attention_messages(seq_length: int, b: int, n: int, d: int, comm_type: str,
                       seed: int = 0) -> List[dict]:
    """Runs on every rank of the CP group: one forward and backward of
    ``context_parallel.attention`` in fp32 on this rank's zig-zag tokens, and the messages
    torch's ``CommDebugMode`` saw (``kind``, ``backward``, ``bytes`` of this rank's input)."""
    cp = parallel_state.get_context_parallel_world_size()
    rank = parallel_state.get_context_parallel_rank()
    mine = context_parallel.positions_on_rank(seq_length, rank, cp)
    q, k, v = (t[mine].requires_grad_() for t in
               attention_inputs(seq_length, b, n, d, seed, device=initialize.get_device()))
    with CollectiveLog() as log:
        out = context_parallel.attention(q, k, v, comm_type=comm_type)
        out.sum().backward()
    return [dict(kind=e["kind"], backward=e["backward"], bytes=e["bytes"]) for e in log.events]


def bytes_rows(messages: Dict[str, List[dict]], seq_length: int, b: int, h: int,
               cp: int) -> List[dict]:
    """Per ``comm_type``: the bytes sent forward and backward, from the messages counted
    (:func:`sent_bytes`) and from the cost model's formula at 4 bytes per value."""
    rows = []
    for comm_type, events in messages.items():
        formula = cp_comm_bytes_per_layer(seq_length, b, h, cp, comm_type, dtype_bytes=4)
        row = dict(comm_type=comm_type, calls=", ".join(sorted({e["kind"] for e in events})))
        for name, backward in (("forward", False), ("backward", True)):
            row[name] = sum(sent_bytes(e["kind"], e["bytes"], cp) for e in events
                            if e["backward"] == backward)
            row[f"{name}_formula"] = formula[name]
        rows.append(row)
    return rows


def format_bytes_rows(rows: List[dict], block: float) -> str:
    """:func:`bytes_rows` in bytes and in K-or-V blocks of ``block`` bytes."""
    lines = [f"{'':<10} {'forward':>8} {'formula':>8} {'backward':>9} {'formula':>8}"
             f"  {'in K/V blocks':<19}",
             f"{'comm_type':<10} {'bytes':>8} {'bytes':>8} {'bytes':>9} {'bytes':>8}"
             f"  {'fwd, f. / bwd, f.':<19} collectives"]
    for r in rows:
        blocks = (f"{r['forward'] / block:g}, {r['forward_formula'] / block:g} / "
                  f"{r['backward'] / block:g}, {r['backward_formula'] / block:g}")
        lines.append(f"{r['comm_type']:<10} {r['forward']:>8g} {r['forward_formula']:>8g} "
                     f"{r['backward']:>9g} {r['backward_formula']:>8g}  {blocks:<19} "
                     f"{r['calls']}")
    return "\n".join(lines)


def format_ranks_once(title: str, tables: Sequence[str]) -> str:
    """One table where every rank produced the same one, saying that they agree; else one per
    rank, each under its rank's title (a rank that differs is the thing to read)."""
    if all(t == tables[0] for t in tables):
        return f"{title};\nthe {len(tables)} ranks agree, one table for all:\n{tables[0]}"
    return "\n".join(f"rank {r}: {title}\n{t}" for r, t in enumerate(tables))
