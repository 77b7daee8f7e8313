"""Activation memory per layer: Korthikanti et al. 2022's formulas (mpu_lab.perf), their terms,
and what autograd really keeps for one TransformerLayer (mpu_lab.perf.saved_activations)."""
import pytest
import torch

from mpu_lab.launcher import run
from mpu_lab.perf import saved_activations
from mpu_lab.perf.cost_model import activation_memory_per_layer

# GPT-3 175B as in the paper's Table 3: a = 96 heads, h = 12288, s = 2048, t = 8.
GPT3 = dict(s=2048, b=1, h=12288, a=96)
SMALL = dict(s=128, b=2, h=64, a=8)        # lab 09's layer: 5as/h = 80, like GPT-3




# --------------------------------------------------------------------------- the formulas
def test_gpt3_attention_term_is_80_and_the_three_rows_give_the_papers_bytes():
    s, b, h, a = GPT3.values()
    assert 5 * a * s / h == 80
    sbh = s * b * h
    assert activation_memory_per_layer(s, b, h, a) == sbh * 114 == 2_868_903_936
    assert activation_memory_per_layer(s, b, h, a, t=8) == sbh * (10 + 3 + 10) == 578_813_952
    assert activation_memory_per_layer(s, b, h, a, t=8, sp=True) == sbh * 114 / 8 == 358_612_992


def test_at_t1_all_rows_agree_and_sequence_parallelism_divides_everything_by_t():
    s, b, h, a = GPT3.values()
    none = activation_memory_per_layer(s, b, h, a)
    assert activation_memory_per_layer(s, b, h, a, 1, sp=True) == none
    for t in (2, 4, 8):
        assert activation_memory_per_layer(s, b, h, a, t, sp=True) == pytest.approx(none / t)
        # TP alone leaves 10 sbh replicated on every rank
        tp_only = activation_memory_per_layer(s, b, h, a, t)
        assert tp_only - activation_memory_per_layer(s, b, h, a, t, sp=True) == \
            pytest.approx(10 * s * b * h * (1 - 1 / t))


def test_formula_rejects_sizes_below_one():
    with pytest.raises(ValueError, match="t must be >= 1"):
        activation_memory_per_layer(1, 1, 1, 1, t=0)


@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (2, True), (4, False), (8, True)])
def test_papers_terms_add_up_to_its_formula(t, sp):
    """The terms against Table 2's closed forms, written out here (activation_memory_per_layer
    is now the terms' sum, so it cannot be the reference)."""
    for shape in (GPT3, SMALL):
        s, b, h, a = shape["s"], shape["b"], shape["h"], shape["a"]
        if sp or t == 1:      # s b h / t (34 + 5 a s / h)
            table2 = s * b * h * (34 + 5 * a * s / h) / t
        else:                 # s b h (10 + 24 / t + 5 a s / (h t))
            table2 = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        terms = saved_activations.paper_terms(**shape, t=t, sequence_parallel=sp)
        assert saved_activations.total(terms) == pytest.approx(table2, rel=1e-12)
        assert activation_memory_per_layer(**shape, t=t, sp=sp) == pytest.approx(table2, rel=1e-12)


def test_terms_refuse_a_split_that_does_not_divide():
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 3"):
        saved_activations.paper_terms(s=128, b=2, h=64, a=8, t=3)


def test_mpu_lab_terms_are_the_papers_in_fp32_without_dropout_plus_bookkeeping():
    s, b, h, a = SMALL.values()
    sbh = s * b * h
    ours = saved_activations.total(saved_activations.mpu_lab_terms(s, b, h, a))
    # 4-byte values, no masks, no separate dropout output: 2 x sbh (32 + 2as/h)
    assert ours == 2 * sbh * (32 + 2 * a * s // h) + 16 * s * b + s * s
    # SP splits what TP leaves replicated, worked by hand for fp32 without dropout: the two
    # LayerNorm inputs (2 x 4sbh), the two column-parallel inputs (2 x 4sbh: Megatron's linear
    # keeps the [s/t, b, h] block) and the LayerNorm statistics (2 x 2 x 4sb): all / t
    t = 2
    sp = saved_activations.total(saved_activations.mpu_lab_terms(s, b, h, a, t, True))
    tp = saved_activations.total(saved_activations.mpu_lab_terms(s, b, h, a, t, False))
    assert tp - sp == (16 * sbh + 16 * s * b) * (t - 1) // t
    megatron_like = saved_activations.total(saved_activations.layer_activation_terms(
        s, b, h, a, t, True, bytes_per_value=4, dropout=False, layernorm_stats=True,
        causal_mask=True))
    assert sp == megatron_like


# --------------------------------------------------------------------------- measuring
def test_saved_tensors_counts_each_storage_once_and_leaves_out_the_weights():
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with saved_activations.SavedTensors(exclude=[w]) as saved:
        y = x @ w              # saves x (and w, excluded)
        z = (x.view(2, 16) * 2).sum() + torch.tanh(y).sum()   # tanh saves its output
    assert saved.bytes == x.numel() * 4 + y.numel() * 4
    assert [n for n, _, _ in saved.listing()] == [128, 128]
    z.backward()               # the counted tensors still serve the backward pass
    assert w.grad is not None


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_measured_bytes_at_tp1_equal_the_mpu_lab_terms_exactly(world, attention, activation):
    row = saved_activations.measured_row(**SMALL, attention_impl=attention, activation=activation)
    assert row["measured"] == row["model"]


def test_sdpa_keeps_no_s_by_s_tensor(world):
    explicit = saved_activations.measured_row(**SMALL)
    sdpa = saved_activations.measured_row(**SMALL, attention_impl="sdpa")
    s, b, h, a = SMALL.values()
    assert explicit["measured"] - sdpa["measured"] == 4 * a * s * s * b + s * s - 4 * a * s * b
    assert all(shape[-1] != s or len(shape) < 2 or shape[-2] != s for _, shape, _ in sdpa["saved"])


@pytest.fixture(scope="module")
def tp2_job():
    """One 2-rank job for every TP = 2 check here (dropout 0, and with --recompute dropout 0.1)."""
    return run("activation_memory.py", ["--tp", 2, "--attention", "explicit", "sdpa",
                                        "--recompute", "--quiet"],
               nproc=2, show="none", timeout_s=240).results


@pytest.mark.slow
def test_tp2_job_measures_the_mpu_lab_terms_and_the_papers_ratios(world, tp2_job):
    rows = tp2_job
    assert rows[0] == rows[1]                      # both ranks keep the same bytes
    tp1 = saved_activations.measured_row(**SMALL)
    tp2, tp2_sp, sdpa, sdpa_sp = rows[0]["rows"]
    for row in (tp2, tp2_sp, sdpa, sdpa_sp):
        assert row["measured"] == row["model"], saved_activations.config_name(row)
    s, b, h, a = SMALL.values()
    sbh = s * b * h
    # TP=2 keeps (16 + 48/2) sbh + 4as^2b/2 (+ LayerNorm statistics and the causal mask)
    assert tp2["measured"] == 4 * sbh * (4 + 12 // 2) + 4 * a * s * s * b // 2 + 16 * s * b + s * s
    # the ratios follow the paper's within a few percent; SP splits exactly the replicated
    # LayerNorm inputs, their statistics and the two column-parallel inputs (worked by hand in
    # test_mpu_lab_terms_are_the_papers_in_fp32_without_dropout_plus_bookkeeping)
    paper = lambda t, sp: activation_memory_per_layer(s, b, h, a, t, sp)  # noqa: E731
    assert tp2["measured"] / tp1["measured"] == pytest.approx(paper(2, False) / paper(1, False), rel=0.05)
    assert tp2["measured"] - tp2_sp["measured"] == (16 * sbh + 16 * s * b) // 2
    assert sdpa_sp["measured"] < sdpa["measured"] < tp2["measured"]


@pytest.mark.slow
def test_tp2_job_saved_bytes_per_recompute_mode_equal_the_hand_worked_fp32_formulas(tp2_job):
    """fp32 values and torch's 4-byte CPU dropout masks (derived in
    tests/perf/test_recompute_against_formulas.py): per sbh 24 replicated + 48/t split, per
    as^2b 12/t; LayerNorm statistics 16sb (/t with SP) and the explicit softmax's s^2 bool mask;
    SDPA with dropout runs torch's math path (+8sbh/t scaled Q and K, no bool mask). Worked for
    s=128 b=2 h=64 a=8, t=2 (sbh = 16384)."""
    s, b, h, a = SMALL.values()
    sbh, t = s * b * h, 2
    expect = {("explicit", False, "none"): 2_379_776, ("explicit", True, "none"): 2_181_120,
              ("explicit", False, "selective"): 790_528, ("explicit", True, "selective"): 591_872,
              ("explicit", False, "full"): 65_536, ("explicit", True, "full"): 32_768}
    assert expect[("explicit", False, "none")] == (24 + 48 // t) * sbh + 12 * a * s * s * b // t \
        + s * s + 16 * s * b
    for (impl, sp, mode), n in list(expect.items()):
        plus = 8 * sbh // t - s * s if mode == "none" else 0      # SDPA's math fallback
        expect[("sdpa", sp, mode)] = n + plus
    for rank in tp2_job:
        got = {(r["attention"], r["sequence_parallel"], r["recompute"]): r["measured"]
               for r in rank["recompute_rows"]}
        assert got == expect
        assert all(r["measured"] == r["derived"] for r in rank["recompute_rows"])
        # FLOPs per rank: a forward is (24sbh^2 + 4bs^2h)/t = 16777216; 3, 3 + core, 4 forwards
        flops = {r["recompute"]: r["counted"] for r in rank["flops_rows"]}
        forward, core = (24 * sbh * h + 4 * b * s * s * h) // t, 4 * b * s * s * h // t
        assert forward == 16_777_216
        assert flops == {"none": 3 * forward, "selective": 3 * forward + core, "full": 4 * forward}
