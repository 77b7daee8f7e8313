"""Memory accounting of a training run (mpu_lab.perf.memory_breakdown, launch/memory_breakdown.py) against
counts worked by hand for the tiny GPT: parameters, gradients, AdamW's and the distributed
optimizer's states, and one micro-batch's activations. One torchrun job of 4 ranks for the
whole file (every configuration re-initialises the groups inside it)."""
import pytest

from documented import COMMANDS, script_and_flags
from mpu_lab.perf import memory_breakdown
from mpu_lab.perf.saved_activations import mpu_lab_terms, total

# the shape, by hand: V = 512 is already a multiple of 128 x t for t in (1, 2): no padding
L, H, A, S, V, MICRO, GLOBAL = 4, 64, 4, 32, 512, 2, 8
CONFIGS = [(1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 1)]
SB = S * MICRO


@pytest.fixture(scope="module")
def rows():
    """The command memory_breakdown.py's docstring shows (tests/documented.py): its
    configurations and optimizers on its 4 ranks, with the model's flags spelled out (the
    script's defaults) and a global batch of 8."""
    script, flags, nproc = script_and_flags(COMMANDS["memory_breakdown.py:1"])
    configs = flags[flags.index("--configs") + 1:flags.index("--optimizers")]
    assert script == "memory_breakdown.py" and nproc == 4
    assert configs == [",".join(map(str, c)) for c in CONFIGS]
    assert flags[flags.index("--optimizers") + 1:] == ["AdamW", "distributed"]
    return memory_breakdown.run_memory_breakdown(
        configs, nproc, (False, True), num_layers=L, hidden_size=H, num_attention_heads=A,
        seq_length=S, vocab_size=V, micro_batch_size=MICRO, global_batch_size=GLOBAL)


def stage_of(rank, t, p, d):
    return rank // (t * d)          # Megatron's rank order: the pipeline is the outer axis


def params_by_hand(t, p, stage):
    """Elements one rank holds (Narayanan et al. 2021 §5.1's count, split as mpu_lab splits)."""
    layer = (3 * H * H // t + 3 * H // t      # QKV, column-parallel: weight and bias split
             + H * H // t + H                 # output projection, row-parallel: bias replicated
             + 4 * H * H // t + 4 * H // t    # fc1, column-parallel
             + 4 * H * H // t + H             # fc2, row-parallel
             + 2 * 2 * H)                     # two LayerNorms (weight, bias), replicated
    if t == 1:
        assert layer == 12 * H * H + 13 * H
    n = L // p * layer
    if stage == 0:
        n += V * H // t + S * H               # word embedding (vocab-parallel), positions
    if stage == p - 1:
        n += 2 * H                            # final LayerNorm
        if p > 1:
            n += V * H // t                   # the last stage's copy of the tied output weight
    return n


def tensors_by_hand(p, stage):
    return L // p * 12 + (2 if stage == 0 else 0) + (2 + (p > 1) if stage == p - 1 else 0)


def by(rows, **match):
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


def test_every_rank_configuration_and_term_is_reported(rows):
    assert len(rows) == len(CONFIGS) * 2 * 4 * len(memory_breakdown.TERMS)
    table = memory_breakdown.format_memory_table(rows).splitlines()
    assert len(table) == 2 + len(CONFIGS) * 2 * 4
    assert table[2].split()[:5] == ["t=1", "p=1", "d=4", "AdamW", "0"]


def test_parameters_and_gradients_match_the_hand_count(rows):
    # Every tensor's size here is a multiple of 32 (h / t, 3h / t, ...), so any bucket of them
    # divides by d in (1, 2, 4): the mirror's flat buffers need no padding, and both paths
    # hold exactly 4 bytes per parameter and 4 per gradient.
    for t, p, d in CONFIGS:
        for r in by(rows, tp=t, pp=p, dp=d, term="parameters"):
            n = params_by_hand(t, p, stage_of(r["rank"], t, p, d))
            assert r["detail"]["param_count"] == n, r
            assert r["measured"] == 4 * n, r
            assert r["detail"]["flat_buffer"] == (r["optimizer"] == "distributed"), r
            grad = by(rows, config=r["config"], optimizer=r["optimizer"], rank=r["rank"],
                      term="gradients")[0]
            assert grad["measured"] == 4 * n, grad


def test_adamw_keeps_8_bytes_per_parameter_plus_a_step_counter_per_tensor(rows):
    for t, p, d in CONFIGS:
        for r in by(rows, tp=t, pp=p, dp=d, term="optimizer", optimizer="AdamW"):
            stage = stage_of(r["rank"], t, p, d)
            tensors = tensors_by_hand(p, stage)
            assert r["detail"]["optimizer_states"] == tensors
            assert r["detail"]["step_bytes"] == 4 * tensors            # fp32 scalar each
            assert r["measured"] - r["detail"]["step_bytes"] == 8 * params_by_hand(t, p, stage)


def test_distributed_optimizer_keeps_a_dth_of_the_moments(rows):
    # No padding (see above): each rank's shard is exactly 1/d of every bucket.
    for t, p, d in CONFIGS:
        ranks = by(rows, tp=t, pp=p, dp=d, term="optimizer", optimizer="distributed")
        assert len(ranks) == 4
        for r in ranks:
            n = params_by_hand(t, p, stage_of(r["rank"], t, p, d))
            moments = r["measured"] - r["detail"]["step_bytes"]
            assert moments * d == 8 * n, (r, n)
            plain = by(rows, config=r["config"], optimizer="AdamW", rank=r["rank"],
                       term="optimizer")[0]
            assert moments * d == plain["measured"] - plain["detail"]["step_bytes"]


def extra_activations_by_hand(t, p, stage):
    """What one micro-batch saves outside the transformer layers (fp32, sb = s x b)."""
    extra = 0
    if stage == 0:
        if t == 1:
            extra += 8 * SB + 8 * SB          # token ids and position ids (int64), embeddings
        else:
            # the vocab-parallel lookup's local ids (int64) and its "outside" mask (bool); the
            # position ids are a view of get_batch's broadcast buffer of 4 int64 [b, s]
            # tensors, which the saved view keeps whole
            extra += 8 * SB + SB + 4 * 8 * SB
    if stage == p - 1:
        extra += 4 * SB * H + 2 * 4 * SB      # final LayerNorm: input, mean and 1/std
        extra += 4 * SB * H                   # the output layer's input
        if t == 1:
            extra += 4 * SB * V + 8 * SB + 4  # F.cross_entropy: log-softmax, targets, weight
        else:
            extra += 4 * SB * V // t + SB + 8 * SB   # softmax, target mask, masked targets
        extra += 4 * SB + 4                   # the loss mask and the divisor of the mean
    return extra


def test_activations_are_the_layer_terms_plus_embedding_and_head_times_in_flight(rows):
    for t, p, d in CONFIGS:
        layer = total(mpu_lab_terms(S, MICRO, H, A, t, attention="sdpa"))   # GPT: SDPA
        m = GLOBAL // (MICRO * d)
        for r in by(rows, tp=t, pp=p, dp=d, term="activations"):
            stage = stage_of(r["rank"], t, p, d)
            per_mb = L // p * layer + extra_activations_by_hand(t, p, stage)
            in_flight = 1 if p == 1 else min(p - stage, m)   # 1F1B (Narayanan et al. §2.2)
            assert r["detail"]["per_micro_batch"] == per_mb, (r, per_mb)
            assert r["detail"]["in_flight"] == in_flight, r
            assert r["measured"] == per_mb * in_flight, r


def test_prediction_is_the_papers_count_at_4_4_8_bytes(rows):
    # Narayanan et al. 2021 §5.1 by hand at t = p = 1: 12 L h^2 + 13 L h + (V + s) h; no
    # final LayerNorm, which is all that separates it from the measured count.
    paper = 12 * L * H * H + 13 * L * H + (V + S) * H
    for optimizer, opt_bytes in (("AdamW", 8 * paper), ("distributed", 8 * paper / 4)):
        got = {r["term"]: r for r in by(rows, tp=1, pp=1, dp=4, rank=0, optimizer=optimizer)}
        assert got["parameters"]["predicted"] == 4 * paper
        assert got["gradients"]["predicted"] == 4 * paper
        assert got["optimizer"]["predicted"] == opt_bytes
        assert got["parameters"]["measured"] - got["parameters"]["predicted"] == 4 * 2 * H
    # Korthikanti et al. 2022 Table 2 with flash attention (no 5as/h): 34 sbh 16-bit bytes
    # per layer, x 4/2 for fp32, L layers, one micro-batch in flight at p = 1
    act = by(rows, tp=1, pp=1, dp=4, rank=0, optimizer="AdamW", term="activations")[0]
    assert act["predicted"] == 34 * S * MICRO * H * 2 * L


def test_bad_configurations_fail_before_any_process_starts():
    with pytest.raises(ValueError, match=r"\(2, 2, 2\).*4 ranks.*got 8"):
        memory_breakdown.run_memory_breakdown([(2, 2, 2)], 4)
    with pytest.raises(ValueError, match="sets .*--tensor-model-parallel-size.* itself"):
        memory_breakdown.run_memory_breakdown([(1, 1, 4)], 4, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="once each"):
        memory_breakdown.run_memory_breakdown([(1, 1, 4)], 4, (True, True))


def test_the_stacked_bar_and_the_saving_table_show_the_measured_bytes(rows, capsys):
    from mpu_lab.labkit.data_parallel.viz import plot_memory_breakdown, print_optimizer_saving
    fig = plot_memory_breakdown(rows, rank=0, unit="B")
    bars = fig.axes[0].patches            # per pair: 4 measured terms, then 4 predicted
    assert len(bars) == len(CONFIGS) * 2 * 2 * 4
    first = by(rows, config="t=1 p=1 d=4", optimizer="AdamW", rank=0)
    top = bars[3].get_y() + bars[3].get_height()
    assert top == pytest.approx(sum(r["measured"] for r in first))
    print_optimizer_saving(rows)
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[:3] for line in lines] == [
        [f"t={t}", f"p={p}", f"d={d}"] for t, p, d in CONFIGS]
    for line, (t, p, d) in zip(lines, CONFIGS):
        assert float(line.split()[-2]) == pytest.approx(d, abs=0.01)   # 8 bytes / (8 / d)
