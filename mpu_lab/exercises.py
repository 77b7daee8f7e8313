"""The labs' exercises: each ``check_*`` function says whether an answer is right.

A check prints one verdict line and returns a :class:`Verdict`, true when the answer is right
and false when it is wrong or missing (the labs ship with ``answer = None``). The expected
value is never hard-coded: it is computed from :mod:`mpu_lab` itself (the pure rank-group
math, the shard arithmetic of :mod:`mpu_lab.viz`), so a check stays right for any parameters
an instructor picks.

    >>> check_group_of_rank([2, 6, 10, 14], rank=6, family="dp", world_size=32, tp=4, pp=2)
    Right: rank 6's dp group is [2, 6, 10, 14].
    Verdict(True)
"""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence

from mpu_lab import parallel_state, viz

RIGHT, WRONG, EMPTY = "Right:", "Not yet:", "No answer yet:"


class Verdict:
    """What a check returns: true when the answer is right. It shows nothing in a notebook
    (the printed line is the verdict), so a check can end a cell without an ``Out[]``."""

    def __init__(self, ok: bool):
        self.ok = bool(ok)

    def __bool__(self) -> bool:
        return self.ok

    def __eq__(self, other) -> bool:
        if isinstance(other, (bool, Verdict)):
            return self.ok == bool(other)
        return NotImplemented

    def __hash__(self):
        return hash(self.ok)

    def __repr__(self) -> str:
        return f"Verdict({self.ok})"

    def _ipython_display_(self):
        pass


def _verdict(ok: bool, right: str, wrong: str) -> Verdict:
    print(f"{RIGHT} {right}" if ok else f"{WRONG} {wrong}")
    return Verdict(ok)


def _unanswered(answer: Any, what: str) -> bool:
    if answer is None or answer is Ellipsis:
        print(f"{EMPTY} replace None with {what}.")
        return True
    return False


def _as_int_list(answer: Any) -> Optional[List[int]]:
    """``answer`` as a list of ints (from a list, tuple, torch.Size, range or tensor), or None."""
    if hasattr(answer, "tolist") and not isinstance(answer, (list, tuple)):
        answer = answer.tolist()
    try:
        items = list(answer)
    except TypeError:
        return None
    out = []
    for item in items:
        if isinstance(item, bool):
            return None
        try:
            value = int(item)
        except (TypeError, ValueError):
            return None
        if value != item:
            return None
        out.append(value)
    return out


def _as_int(answer: Any) -> Optional[int]:
    if isinstance(answer, bool):
        return None
    try:
        value = int(answer)
    except (TypeError, ValueError):
        return None
    return value if value == answer else None


# --------------------------------------------------------------------------- lab 01
def check_group_of_rank(answer: Any, rank: int, family: str, world_size: int, tp: int = 1,
                        pp: int = 1, cp: int = 1, order: str = parallel_state.DEFAULT_ORDER) -> Verdict:
    """Is ``answer`` the ``family`` group (e.g. ``"dp"``) that holds ``rank``, in Megatron's order?"""
    if _unanswered(answer, f"the list of ranks in rank {rank}'s {family} group"):
        return Verdict(False)
    groups = parallel_state.generate_rank_groups(world_size, tp, pp, cp, order)
    (expected,) = [g for g in groups[family] if rank in g]
    given = _as_int_list(answer)
    if given is not None and sorted(given) == sorted(expected) and given != expected:
        return _verdict(False, "", f"the right ranks, but Megatron lists them as {expected}; "
                                   f"order the ranks by their {family} rank (ascending here).")
    hint = (f"{family} groups hold ranks that agree on every coordinate except {family}; with "
            f"order {order!r}, rank = tp_rank + t*(cp_rank + c*(dp_rank + d*pp_rank)).")
    return _verdict(given == expected, f"rank {rank}'s {family} group is {expected}.",
                    f"{answer!r} is not rank {rank}'s {family} group. Hint: {hint}")


def check_crossing_count(answer: Any, family: str, world_size: int, tp: int = 1, pp: int = 1,
                         cp: int = 1, order: str = parallel_state.DEFAULT_ORDER,
                         gpus_per_node: int = 8) -> Verdict:
    """How many ``family`` groups have ranks in more than one box of ``gpus_per_node`` GPUs?"""
    if _unanswered(answer, f"the number of {family} groups that cross a node boundary"):
        return Verdict(False)
    groups = parallel_state.generate_rank_groups(world_size, tp, pp, cp, order)
    crossing = viz.groups_crossing_nodes(groups[family], gpus_per_node)
    return _verdict(_as_int(answer) == len(crossing),
                    f"{len(crossing)} of {len(groups[family])} {family} groups cross a node "
                    f"boundary: {crossing}.",
                    f"{answer!r} is not it. Hint: node k holds ranks {gpus_per_node}k ... "
                    f"{gpus_per_node}k+{gpus_per_node - 1}; list the {family} groups with "
                    f"generate_rank_groups and look for one that straddles such a boundary.")


# --------------------------------------------------------------------------- labs 02/03
def _column_weight_shape(input_size: int, output_size: int, tp: int) -> tuple:
    (rows, cols) = viz.shard_shapes("column", input_size, output_size, tp)[0]  # A_i: [in, out/t]
    return (cols, rows)                                                        # W_i = A_i^T


def check_column_weight_shape(answer: Any, input_size: int, output_size: int, tp: int) -> Verdict:
    """Shape of one rank's ``ColumnParallelLinear(input_size, output_size).weight`` at ``tp``."""
    if _unanswered(answer, "a shape such as (rows, cols)"):
        return Verdict(False)
    expected = _column_weight_shape(input_size, output_size, tp)
    given = _as_int_list(answer)
    if given is not None and tuple(given) == expected[::-1] and expected[0] != expected[1]:
        return _verdict(False, "", f"{tuple(given)} is A_i = [in, out/t]; the Parameter stores "
                                   f"W_i = A_i^T because F.linear computes X W^T.")
    return _verdict(given is not None and tuple(given) == expected,
                    f"each rank stores weight {expected}: A_i = [{input_size}, "
                    f"{output_size // tp}] transposed, cut by the tensor-parallel size {tp}.",
                    f"{answer!r} is not it. Hint: the columns of A (output_size) are cut into t "
                    f"pieces, and the weight is stored as [out/t, in].")


def check_strided_rows(answer: Any, rank: int, size: int, tp: int, stride: int) -> Verdict:
    """Which rows of a fused ``[size, ...]`` master weight does ``rank`` keep with ``stride``?"""
    if _unanswered(answer, f"the list of master-weight rows that rank {rank} keeps"):
        return Verdict(False)
    owners = viz.strided_owners(size, tp, stride)
    expected = [row for row, owner in enumerate(owners) if owner == rank]
    given = _as_int_list(answer)
    return _verdict(given is not None and sorted(given) == expected,
                    f"rank {rank} keeps rows {expected}: one piece of {size // (tp * stride)} "
                    f"rows from each of the {stride} fused parts.",
                    f"{answer!r} is not it. Hint: cut the {size} rows into tp*stride = "
                    f"{tp * stride} pieces; rank r keeps pieces r, r+{tp}, r+{2 * tp}, ...")


def check_row_weight_shape(answer: Any, input_size: int, output_size: int, tp: int) -> Verdict:
    """Shape of one rank's ``RowParallelLinear(input_size, output_size).weight`` at ``tp``."""
    if _unanswered(answer, "a shape such as (rows, cols)"):
        return Verdict(False)
    (rows, cols) = viz.shard_shapes("row", input_size, output_size, tp)[0]  # A_i: [in/t, out]
    expected = (cols, rows)
    given = _as_int_list(answer)
    if given is not None and tuple(given) == (rows, cols) and rows != cols:
        return _verdict(False, "", f"{(rows, cols)} is A_i = [in/t, out]; the Parameter stores "
                                   f"W_i = A_i^T because F.linear computes X W^T.")
    return _verdict(given is not None and tuple(given) == expected,
                    f"each rank stores weight {expected}: A_i = [{rows}, {cols}] transposed, "
                    f"the rows of A cut by the tensor-parallel size {tp}.",
                    f"{answer!r} is not it. Hint: the rows of A (input_size) are cut into t "
                    f"pieces, and the weight is stored as [out, in/t].")


# Collectives of one tensor-parallel MLP, Column(gather_output=False) -> Row(input_is_parallel=True):
# forward: f is the identity, g all-reduces once; backward: g is the identity, f all-reduces once.
MLP_ALL_REDUCES = {"forward": 1, "backward": 1}


def check_mlp_all_reduces(answer: Any) -> Verdict:
    """All-reduces of one tensor-parallel MLP (Megatron-LM §3): ``(forward, backward)``."""
    if _unanswered(answer, "a pair (forward, backward) of counts"):
        return Verdict(False)
    given = _as_int_list(answer)
    expected = [MLP_ALL_REDUCES["forward"], MLP_ALL_REDUCES["backward"]]
    return _verdict(given == expected,
                    "one all-reduce forward (g after the row-parallel layer) and one backward "
                    "(f before the column-parallel layer).",
                    f"{answer!r} is not it. Hint: with gather_output=False and "
                    f"input_is_parallel=True nothing is gathered or scattered; only f and g "
                    f"communicate, each in one direction.")


# --------------------------------------------------------------------------- lab 04
def group_sum_of_ranks(rank: int, world_size: int, tp: int, pp: int = 1) -> int:
    """What an all-reduce of each rank's own rank number gives on ``rank`` over its TP group —
    Megatron's copy-to test: 6 on ranks 0-3 and 22 on ranks 4-7 for 8 ranks at tp=4."""
    groups = parallel_state.generate_rank_groups(world_size, tp, pp)
    (group,) = [g for g in groups["tp"] if rank in g]
    return sum(group)


def gather_split_expected(rank: int, world_size: int, tp: int, pp: int = 1,
                          shape: Sequence[int] = (2, 4)) -> List[float]:
    """``gather_split_1d_tensor`` of tensors filled with their rank, as seen on ``rank``."""
    groups = parallel_state.generate_rank_groups(world_size, tp, pp)
    (group,) = [g for g in groups["tp"] if rank in g]
    numel = 1
    for s in shape:
        numel *= s
    return [float(r) for r in group for _ in range(numel)]


def check_all_reduce_of_ranks(answer: Any, rank: int, world_size: int, tp: int, pp: int = 1) -> Verdict:
    """Predict the all-reduce (sum over the TP group) of the rank numbers, seen on ``rank``."""
    if _unanswered(answer, f"the number rank {rank} holds after the all-reduce"):
        return Verdict(False)
    expected = group_sum_of_ranks(rank, world_size, tp, pp)
    return _verdict(_as_int(answer) == expected,
                    f"rank {rank}'s tensor-parallel group sums to {expected}.",
                    f"{answer!r} is not it. Hint: only the ranks of rank {rank}'s tensor-parallel "
                    f"group take part; add up their rank numbers.")


def check_gather_split(answer: Any, rank: int, world_size: int, tp: int, pp: int = 1,
                       shape: Sequence[int] = (2, 4)) -> Verdict:
    """Predict ``gather_split_1d_tensor`` on ``rank`` when every rank holds ``ones(shape) * rank``."""
    if _unanswered(answer, f"the 1-D list of values rank {rank} ends up with"):
        return Verdict(False)
    expected = gather_split_expected(rank, world_size, tp, pp, shape)
    given = answer.tolist() if hasattr(answer, "tolist") else answer
    try:
        given = [float(v) for v in given]
    except (TypeError, ValueError):
        given = None
    groups = parallel_state.generate_rank_groups(world_size, tp, pp)
    (group,) = [g for g in groups["tp"] if rank in g]
    return _verdict(given == expected,
                    f"{len(expected)} values: each of the ranks {group} contributes its "
                    f"{len(expected) // len(group)} flattened elements, in group order.",
                    f"that is not it ({len(given) if given else 0} values given, "
                    f"{len(expected)} expected). Hint: flatten each rank's tensor and "
                    f"concatenate over the tensor-parallel group, lowest rank first.")


def _ranges(by_value: dict) -> str:
    return ", ".join(f"ranks {rs[0]}-{rs[-1]} hold {v:g}" if len(rs) > 1 else f"rank {rs[0]} holds {v:g}"
                     for v, rs in by_value.items())


def _megatron_expectation(name: str, rank: int, got: dict, world_size: int) -> bool:
    """Megatron's unit-test assertion for test ``name`` on ``rank`` (layouts of COLLECTIVE_LAYOUTS)."""
    tp, pp = viz.COLLECTIVE_LAYOUTS[name]
    (group,) = [g for g in parallel_state.generate_rank_groups(world_size, tp, pp)["tp"] if rank in g]
    pos = group.index(rank)
    if name == "broadcast":
        return got["src"] == group[0] and got["means"] == [0.0, 1.0]
    if name in ("copy", "reduce"):
        return got["value"] == sum(group)
    if name == "scatter":
        return got["column"] == pos
    if name == "gather":
        return got["blocks"] == group
    if name == "gather_split":
        return got["output"] == gather_split_expected(rank, world_size, tp, pp)
    if name == "sequence":
        return got["rows"] == [2 * pos, 2 * pos + 2] and got["reduce_scatter"] == tp * pos
    raise ValueError(f"unknown test {name!r}")


def check_megatron_expectations(results: Sequence[dict]) -> Verdict:
    """Hold every rank's values from ``launch/collectives.py`` to Megatron's unit tests.

    One line per test; for copy-to and reduce-from it spells out the famous sums (6 on ranks
    0-3 and 22 on ranks 4-7 for 8 ranks at tp=4). Expectations come from the rank-group math,
    so they hold for any multiple of 8 ranks.
    """
    world = len(results)
    ok_all = True
    for name in results[0]["tests"]:
        ok = all(_megatron_expectation(name, r, res["tests"][name], world)
                 for r, res in enumerate(results))
        ok_all &= ok
        detail = ""
        if name in ("copy", "reduce"):
            by_value = {}
            for r, res in enumerate(results):
                by_value.setdefault(res["tests"][name]["value"], []).append(r)
            detail = ": " + _ranges(by_value)
        tp, pp = viz.COLLECTIVE_LAYOUTS[name]
        print(f"{name:<12} (tp={tp}, pp={pp}) {'as Megatron expects' if ok else 'DIFFERS from Megatron'}"
              f"{detail}")
    return _verdict(ok_all, f"all {world} ranks agree with Megatron's unit tests.",
                    "some values differ from Megatron's unit tests (see above).")


def summarize(results: Iterable[bool]) -> str:
    """``3 of 4 right`` for a list of check results."""
    results = list(results)
    return f"{sum(bool(r) for r in results)} of {len(results)} right"


# --------------------------------------------------------------------------- lab 05
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


def check_layer_shape(answer: Any, tensor: str, B: int, L: int, D: int, n_H: int,
                      d_tp: int) -> Verdict:
    """Shape of ``tensor`` (a row of the lecture's table, e.g. ``"A"``) on one rank."""
    if _unanswered(answer, f"the shape of {tensor} on one rank, e.g. (B, L, something)"):
        return Verdict(False)
    shapes = lecture_shapes(B, L, D, n_H, d_tp)
    if tensor not in shapes:
        raise ValueError(f"no tensor {tensor!r} in the lecture's table; it has {list(shapes)}")
    expected, per_rank = shapes[tensor]
    given = _as_int_list(answer)
    many = f" (each rank holds {per_rank} of them)" if per_rank > 1 else ""
    return _verdict(given is not None and tuple(given) == expected,
                    f"{tensor} is {expected} on each of the {d_tp} ranks{many}.",
                    f"{answer!r} is not it. Hint: only the dimensions inside the tensor-parallel "
                    f"blocks (D/d_tp for Q, K, V, Z; 4D/d_tp for A, A') are cut; B and L never "
                    f"are, and Out and x' are whole after the all-reduce.")


def valid_tensor_parallel_sizes(hidden_size: int, num_attention_heads: int) -> List[int]:
    """The sizes ``t`` at which :class:`~mpu_lab.models.TransformerConfig` accepts the layer
    (whole heads per rank; the MLP splits too)."""
    from mpu_lab.models import TransformerConfig
    config = TransformerConfig(num_layers=1, hidden_size=hidden_size,
                               num_attention_heads=num_attention_heads)
    sizes = []
    for t in range(1, num_attention_heads + 1):
        try:
            config.check(t)
        except ValueError:
            continue
        sizes.append(t)
    return sizes


def check_tensor_parallel_sizes(answer: Any, hidden_size: int, num_attention_heads: int) -> Verdict:
    """Every tensor-parallel size that can split a layer of ``num_attention_heads`` heads."""
    if _unanswered(answer, "the list of every tensor-parallel size that works"):
        return Verdict(False)
    expected = valid_tensor_parallel_sizes(hidden_size, num_attention_heads)
    given = _as_int_list(answer)
    return _verdict(given is not None and sorted(given) == expected,
                    f"t in {expected}: each rank must hold whole heads, so t divides "
                    f"n_H = {num_attention_heads} (and so t <= n_H).",
                    f"{answer!r} is not it. Hint: a head is never cut, so n_H / t must be a "
                    f"whole number.")


def _collective_total(counts: dict, kind: str) -> int:
    return sum(direction.get(kind, 0) for direction in counts.values())


def check_layer_collectives(answer: Any, sequence_parallel: bool, tp: int = 2) -> Verdict:
    """Collectives of one transformer layer per training step, forward plus backward:
    ``(all_reduces, all_gathers, reduce_scatters)``."""
    if _unanswered(answer, "a triple (all_reduces, all_gathers, reduce_scatters)"):
        return Verdict(False)
    from mpu_lab.models import expected_layer_counts
    counts = expected_layer_counts(sequence_parallel, tp)
    expected = [_collective_total(counts, k) for k in ("all_reduce", "all_gather", "reduce_scatter")]
    given = _as_int_list(answer)
    mode = "with" if sequence_parallel else "without"
    return _verdict(given == expected,
                    f"{mode} sequence parallelism one layer issues {tuple(expected)} per step "
                    f"(all-reduces, all-gathers, reduce-scatters), forward and backward together.",
                    f"{answer!r} is not it. Hint: count the f and g of both blocks, forward and "
                    f"backward; with sequence parallelism f becomes an all-gather and g a "
                    f"reduce-scatter, and each one's backward is the other.")


def check_activation_memory_mib(answer: Any, s: int, b: int, h: int, a: int, t: int = 1,
                                sp: bool = False, rtol: float = 0.01) -> Verdict:
    """Korthikanti et al.'s activation memory of one layer, in MiB (within ``rtol``)."""
    if _unanswered(answer, "a number of MiB"):
        return Verdict(False)
    from mpu_lab.perf import activation_memory_per_layer
    expected = activation_memory_per_layer(s, b, h, a, t, sp) / 2 ** 20
    try:
        value = float(answer)
    except (TypeError, ValueError):
        value = None
    mode = f"t = {t}" + (" with sequence parallelism" if sp else "")
    return _verdict(value is not None and abs(value - expected) <= rtol * expected,
                    f"{expected:.0f} MiB per layer at {mode}.",
                    f"{answer!r} is not it. Hint: sbh/t (34 + 5as/h) bytes with sequence "
                    f"parallelism, sbh (10 + 24/t + 5as/(ht)) without; 1 MiB = 2^20 bytes.")


# --------------------------------------------------------------------------- lab 06
def check_bubble_share(answer: Any, p: int, m: int, v: int = 1, tol: float = 0.005) -> Verdict:
    """The idle share of a pipeline iteration, ``(p-1)/(v·m + p-1)`` (within ``tol``)."""
    if _unanswered(answer, "the bubble's share of the iteration, a number between 0 and 1"):
        return Verdict(False)
    from mpu_lab.pipeline_parallel.timeline import analytic_bubble
    expected = analytic_bubble(p, m, v)
    try:
        value = float(answer)
    except (TypeError, ValueError):
        value = None
    return _verdict(value is not None and abs(value - float(expected["share"])) <= tol,
                    f"{expected['share']} = {float(expected['share']):.3f} of the iteration is "
                    f"idle (bubble / ideal time = (p-1)/(v m) = {expected['relative']}).",
                    f"{answer!r} is not it. Hint: the bubble lasts p-1 slots of 1/v, the work "
                    f"m slots of 1/v per stage; give bubble / (bubble + work).")


def check_peak_in_flight(answer: Any, schedule: str, p: int, m: int, stage: int = 0,
                         v: int = 1) -> Verdict:
    """Most micro-batches whose forward has run and backward not yet, on one stage."""
    if _unanswered(answer, "a number of micro-batches"):
        return Verdict(False)
    from mpu_lab.pipeline_parallel.timeline import simulate
    expected = simulate(schedule, p, m, v).peak_in_flight[stage]
    return _verdict(_as_int(answer) == expected,
                    f"stage {stage} holds at most {expected} micro-batches' activations under "
                    f"{schedule} with p = {p}, m = {m}.",
                    f"{answer!r} is not it. Hint: count the forwards a stage runs before its "
                    f"first backward; GPipe runs all m first, 1F1B only enough to fill the pipeline.")


# --------------------------------------------------------------------------- lab 07
def check_micro_batches(answer: Any, gpt_args: str, world_size: int) -> Verdict:
    """Micro-batches each data-parallel replica runs per iteration for a launch line."""
    if _unanswered(answer, "the number of micro-batches per iteration"):
        return Verdict(False)
    from mpu_lab.train_runs import derived
    d = derived(gpt_args, world_size)
    return _verdict(_as_int(answer) == d["num_micro_batches"],
                    f"DP = {world_size} / (TP x PP) = {d['data_parallel_size']}, so "
                    f"{d['num_micro_batches']} micro-batch(es) = global batch / (micro batch x DP).",
                    f"{answer!r} is not it. Hint: first DP = world size / (TP x PP); then "
                    f"global batch = micro batch x micro-batches x DP.")


def check_padded_vocab(answer: Any, vocab_size: int, divisible_by: int, tp: int) -> Verdict:
    """The vocabulary Megatron pads ``vocab_size`` to at tensor-parallel size ``tp``."""
    if _unanswered(answer, "the padded vocabulary size"):
        return Verdict(False)
    from mpu_lab.models import pad_vocab_size
    expected = pad_vocab_size(vocab_size, divisible_by, tp)
    return _verdict(_as_int(answer) == expected,
                    f"{expected} = the next multiple of {divisible_by} x {tp} = "
                    f"{divisible_by * tp}; each rank holds {expected // tp} rows of the embedding.",
                    f"{answer!r} is not it. Hint: round {vocab_size} up to a multiple of "
                    f"--make-vocab-size-divisible-by x TP, so every rank holds the same number "
                    f"of whole rows.")


# --------------------------------------------------------------------------- lab 08
def check_best_config(answer: Any, model, cluster, num_gpus: int, global_batch_size: int,
                      tol: float = 0.05) -> Verdict:
    """A ``(t, p)`` whose best configuration (over the micro-batch sizes) fits in memory and is
    predicted within ``tol`` of the fastest one :func:`mpu_lab.perf.explore` finds."""
    if _unanswered(answer, "a pair (t, p): tensor- and pipeline-parallel sizes"):
        return Verdict(False)
    from mpu_lab.perf import explore
    result = explore(model, cluster, num_gpus, global_batch_size)
    best = result.best
    pair = _as_int_list(answer)
    mine = [c for c in result.candidates
            if pair is not None and len(pair) == 2 and (c.config.tp, c.config.pp) == tuple(pair)]
    chosen = min(mine, key=lambda c: (not c.fits, c.prediction.total_s)) if mine else None
    fast = chosen is not None and chosen.fits and \
        chosen.prediction.total_s <= (1 + tol) * best.prediction.total_s
    b, fastest = best.config, best.prediction.total_s
    if chosen is None:
        mine = (f"{answer!r} is not a valid (t, p) for {num_gpus} GPUs with batch "
                f"{global_batch_size}.")
    else:
        mine = (f"(t={chosen.config.tp}, p={chosen.config.pp}): at best "
                f"{chosen.prediction.total_s:.2f} s per iteration"
                f"{'' if chosen.fits else ', and it does not fit in memory'}.")
    return _verdict(fast,
                    f"{mine} That is within {tol:.0%} of the fastest, t={b.tp}, p={b.pp}, "
                    f"d={b.dp}, b={b.b}: {fastest:.2f} s.",
                    f"{mine} The fastest takes {fastest:.2f} s. Hint: keep t within a node "
                    f"({cluster.gpus_per_node} GPUs), then use the fewest pipeline stages that "
                    f"fit in memory; explore() ranks them all.")


def check_min_microbatches(answer: Any, p: int, max_bubble: float, v: int = 1) -> Verdict:
    """The fewest micro-batches m for which the bubble, relative to the ideal time
    ((p-1)/(v·m), :func:`mpu_lab.perf.bubble_fraction`), is at most ``max_bubble``."""
    if _unanswered(answer, "a number of micro-batches"):
        return Verdict(False)
    from mpu_lab.perf import bubble_fraction
    m = 1
    while bubble_fraction(p, m, v) > max_bubble + 1e-12:
        m += 1
    return _verdict(_as_int(answer) == m,
                    f"m = {m}: the bubble is (p-1)/(v m) = {p - 1}/({v}·{m}) = "
                    f"{bubble_fraction(p, m, v):.4f} of the ideal time (m = {m - 1} gives "
                    f"{bubble_fraction(p, max(m - 1, 1), v):.4f}).",
                    f"{answer!r} is not it. Hint: solve (p-1)/(v m) <= {max_bubble} for the "
                    f"smallest whole m.")


_COMM_NAMES = {"tp": "tp", "tensor": "tp", "pp": "pp", "pipeline": "pp", "p2p": "pp",
               "dp": "dp", "data": "dp"}


def check_dominant_communication(answer: Any, model, config, cluster) -> Verdict:
    """Which communication the cost model puts the most time on for ``config``: ``"tp"``
    (tensor-parallel collectives), ``"pp"`` (pipeline send/recv) or ``"dp"`` (the exposed
    data-parallel gradient all-reduce) — from :func:`mpu_lab.perf.predict_iteration`."""
    if _unanswered(answer, '"tp", "pp" or "dp"'):
        return Verdict(False)
    from mpu_lab.perf import predict_iteration
    pred = predict_iteration(model, config, cluster)
    times = {"tp": pred.tp_comm_s, "pp": pred.pp_p2p_s, "dp": pred.dp_comm_s}
    expected = max(times, key=times.get)
    given = _COMM_NAMES.get(str(answer).strip().lower().split()[0] if str(answer).strip() else "")
    shares = ", ".join(f"{k} {v / pred.total_s:.1%}" for k, v in times.items())
    return _verdict(given == expected,
                    f"{expected}: {shares} of the iteration.",
                    f"{answer!r} is not it. Hint: with t = {config.tp}, p = {config.pp}, "
                    f"d = {config.dp}, which groups exist at all, and which of them moves the "
                    f"most bytes per iteration over the slowest link?")


# --------------------------------------------------------------------------- playground, labs 02-04
# Each lab runs the operator live on a playground world (mpu_lab.playground); the learner
# predicts one rank's tensor first. The expected tensors below come from the pure rank-group
# math and plain Python sums, never from the playground or the mappings themselves.
def _tp_group_of(rank: int, world_size: int, tp: int, pp: int = 1) -> List[int]:
    (group,) = [g for g in parallel_state.generate_rank_groups(world_size, tp, pp)["tp"]
                if rank in g]
    return group


def _as_floats(answer: Any) -> Optional[List[float]]:
    """A number, a (nested) list or a tensor, flattened to floats; None if it is not numbers."""
    if hasattr(answer, "tolist"):
        answer = answer.tolist()
    flat, todo = [], [answer]
    while todo:
        item = todo.pop(0)
        if isinstance(item, (list, tuple)):
            todo = list(item) + todo
        elif isinstance(item, bool):
            return None
        else:
            try:
                flat.append(float(item))
            except (TypeError, ValueError):
                return None
    return flat


def copy_to_grad_expected(rank: int, world_size: int, tp: int, pp: int = 1,
                          size: int = 4) -> List[float]:
    """``x.grad`` on ``rank`` after ``y = copy_to_tensor_model_parallel_region(x)`` and
    ``y.backward(torch.full((size,), r + 1.0))`` on every rank r: f's backward all-reduces
    dL/dy over the tensor-parallel group (Megatron-LM, Shoeybi et al. 2019, §3, Fig. 3)."""
    return [float(sum(r + 1 for r in _tp_group_of(rank, world_size, tp, pp)))] * size


def reduce_from_expected(rank: int, world_size: int, tp: int, pp: int = 1,
                         size: int = 4) -> List[float]:
    """``reduce_from_tensor_model_parallel_region(torch.arange(size) * (r + 1))`` on ``rank``
    when every rank r holds its own multiple of ``arange``: g's forward all-reduce (§3)."""
    total = sum(r + 1 for r in _tp_group_of(rank, world_size, tp, pp))
    return [float(i * total) for i in range(size)]


def reduce_scatter_sequence_expected(rank: int, world_size: int, tp: int, pp: int = 1,
                                     cols: int = 2) -> List[List[float]]:
    """``reduce_scatter_to_sequence_parallel_region(x)`` on ``rank`` when every rank r holds
    ``x = torch.arange(tp * cols).reshape(tp, cols) * (r + 1)``: the group's sum, of which the
    rank keeps row ``tp_rank`` along the sequence (Korthikanti et al. 2022, §4.2.2)."""
    group = _tp_group_of(rank, world_size, tp, pp)
    total, row = sum(r + 1 for r in group), group.index(rank)
    return [[float((row * cols + j) * total) for j in range(cols)]]


def _check_tensor(answer: Any, expected: List, what: str, why: str, hint: str) -> Verdict:
    if _unanswered(answer, what):
        return Verdict(False)
    return _verdict(_as_floats(answer) == _as_floats(expected), f"{expected}: {why}",
                    f"{answer!r} is not it. {hint}")


def check_copy_to_grad(answer: Any, rank: int, world_size: int, tp: int, pp: int = 1) -> Verdict:
    """Predict ``x.grad`` on ``rank`` after f with dL/dy = rank + 1 on every rank (4 values)."""
    group = _tp_group_of(rank, world_size, tp, pp)
    return _check_tensor(answer, copy_to_grad_expected(rank, world_size, tp, pp),
                         f"rank {rank}'s x.grad, a list of 4 numbers",
                         f"the sum of r + 1 over the group {group}.",
                         f"Hint: f's backward all-reduces dL/dy over rank {rank}'s "
                         f"tensor-parallel group {group}; each rank r sent r + 1.")


def check_reduce_from(answer: Any, rank: int, world_size: int, tp: int, pp: int = 1) -> Verdict:
    """Predict g's output on ``rank`` when rank r holds ``torch.arange(4.) * (r + 1)``."""
    group = _tp_group_of(rank, world_size, tp, pp)
    return _check_tensor(answer, reduce_from_expected(rank, world_size, tp, pp),
                         f"rank {rank}'s tensor after reduce_from, a list of 4 numbers",
                         f"arange(4) times the sum of r + 1 over the group {group}.",
                         f"Hint: g all-reduces (sums) over rank {rank}'s tensor-parallel group "
                         f"{group}, element by element.")


def check_reduce_scatter_to_sequence(answer: Any, rank: int, world_size: int, tp: int,
                                     pp: int = 1) -> Verdict:
    """Predict ``reduce_scatter_to_sequence_parallel_region`` on ``rank`` when rank r holds
    ``torch.arange(2. * tp).reshape(tp, 2) * (r + 1)``."""
    group = _tp_group_of(rank, world_size, tp, pp)
    return _check_tensor(answer, reduce_scatter_sequence_expected(rank, world_size, tp, pp),
                         f"rank {rank}'s tensor, e.g. [[a, b]]",
                         f"row {group.index(rank)} of the sum over the group {group}.",
                         f"Hint: sum the ({tp}, 2) tensors of the group {group}, then rank "
                         f"{rank} keeps row {group.index(rank)} (its tensor-parallel rank).")
