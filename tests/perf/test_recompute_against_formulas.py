"""Activation recomputation against Korthikanti et al. 2022 (mpu_lab.perf.recompute; the file is
not test_recompute.py, a name tests/models holds): the bytes
autograd keeps per layer under none / selective / full recomputation with dropout on, and the
FLOPs of a step, each against a formula worked out by hand here (the TP = 2 rows run in
tests/perf/test_saved_activations.py's one job)."""
import pytest
import torch
import torch.nn.functional as F

from mpu_lab.perf import recompute
from mpu_lab.perf.cost_model import (ModelShape, activation_memory_per_layer,
                                     hardware_flops_per_iteration)
from mpu_lab.perf.cost_model.counts import paper_flops_per_iteration
from mpu_lab.perf.saved_activations import SavedTensors

GPT3 = dict(s=2048, b=1, h=12288, a=96)
SMALL = dict(s=128, b=2, h=64, a=8)        # as/h = 16
TINY = dict(s=16, b=2, h=32, a=4)


def lab_formula(s, b, h, a, t=1, sp=False, mode="none", sdpa_math=False):
    """Worked by hand for fp32 values (v = 4) and torch's CPU dropout masks (m = 4): per sbh
    16v + 2m = 72 (4v + 2m = 24 replicated without SP, 12v = 48 split), per as^2b/t 2v + m = 12;
    LayerNorm statistics 16sb (/t with SP); the explicit softmax's bool causal mask s^2.
    SDPA's math fallback adds scaled Q and K (8sbh/t) and has no bool mask."""
    sbh, sb = s * b * h, s * b
    split = 48 + (8 if sdpa_math and mode == "none" else 0)
    if mode == "full":
        return 4 * sbh // (t if sp else 1)
    body = (24 + split) * sbh // t if sp else 24 * sbh + split * sbh // t
    stats = 16 * sb // (t if sp else 1)
    if mode == "selective":
        return body + stats
    return body + 12 * a * s * s * b // t + stats + (0 if sdpa_math else s * s)


# --------------------------------------------------------------------------- the formulas
def test_papers_recompute_rows_for_gpt3_are_10_plus_24_over_t_34_over_t_and_2():
    s, b, h, a = GPT3.values()
    sbh = s * b * h
    assert activation_memory_per_layer(s, b, h, a, 8, False, "selective") == sbh * (10 + 3)
    assert activation_memory_per_layer(s, b, h, a, 8, True, "selective") == sbh * 34 / 8
    assert activation_memory_per_layer(s, b, h, a, 8, False, "full") == 2 * sbh
    assert activation_memory_per_layer(s, b, h, a, 8, True, "full") == 2 * sbh / 8
    with pytest.raises(ValueError, match="recompute must be one of"):
        activation_memory_per_layer(s, b, h, a, recompute="some")


@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (2, True), (4, True)])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_lab_terms_are_the_hand_worked_fp32_formula(t, sp, mode):
    for attention in ("explicit", "sdpa"):
        terms = recompute.lab_terms(**SMALL, t=t, sequence_parallel=sp, recompute=mode,
                                    attention_impl=attention)
        assert recompute.total(terms) == lab_formula(**SMALL, t=t, sp=sp, mode=mode,
                                                     sdpa_math=attention == "sdpa")


def test_formulas_give_the_papers_constants_at_v2_m1_and_the_labs_at_v4_m4():
    paper, lab = recompute.formulas(2, 1), recompute.formulas(4, 4)
    assert paper["none, TP"] == "sbh(10 + 24/t + 5as/(ht))"
    assert paper["none, TP+SP"] == "sbh(34 + 5as/h)/t"
    assert paper["selective, TP+SP"] == "34sbh/t" and paper["full, TP"] == "2sbh"
    assert lab["none, TP"] == "sbh(24 + 48/t + 12as/(ht))"
    assert lab["selective, TP"] == "sbh(24 + 48/t)" and lab["full, TP+SP"] == "4sbh/t"


def test_on_a_cpu_torch_dropout_keeps_a_4_byte_scaled_mask_not_a_bool():
    """The assumption behind m = 4 (the paper's mask is 1 byte)."""
    x = torch.randn(16, 8, requires_grad=True)
    with SavedTensors() as saved:
        F.dropout(x, 0.1, training=True)
    assert [(n, dtype) for n, _, dtype in saved.listing()] == [(16 * 8 * 4, "float32")]
    assert recompute.mask_bytes("cpu") == 4 and recompute.mask_bytes("cuda") == 1


def test_on_a_cpu_sdpa_with_dropout_keeps_s_by_s_tensors_and_without_keeps_none():
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    for p, expect_square in ((0.1, True), (0.0, False)):
        with SavedTensors() as saved:
            F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        square = any(len(shape) >= 2 and shape[-2:] == (16, 16) for _, shape, _ in saved.listing())
        assert square == expect_square
        assert recompute.attention_kind("sdpa", p > 0) == ("sdpa_math" if p else "sdpa")


# --------------------------------------------------------------------------- measured
@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_saved_bytes_of_one_layer_with_dropout_equal_the_derived_formula(world, mode, attention):
    saved = recompute.measure_saved_bytes(**SMALL, recompute=mode, attention_impl=attention)
    assert saved.bytes == lab_formula(**SMALL, mode=mode, sdpa_math=attention == "sdpa")


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_saved_bytes_in_bf16_on_a_cpu_equal_the_derived_formula(world, mode):
    """bf16 on a CPU: v = 2, the dropout noise m = 2, the explicit softmax kept in fp32 (4) and
    LayerNorm's statistics in bf16: per sbh 16v + 2m = 36, per as^2b 4 + v + m = 8, plus s^2
    and 8sb; selective 36 sbh + 8sb; full 2 sbh."""
    s, b, h, a = SMALL.values()
    sbh = s * b * h
    expect = {"none": 36 * sbh + 8 * a * s * s * b + s * s + 8 * s * b,
              "selective": 36 * sbh + 8 * s * b, "full": 2 * sbh}[mode]
    saved = recompute.measure_saved_bytes(**SMALL, recompute=mode, dtype=torch.bfloat16)
    assert saved.bytes == expect
    terms = recompute.lab_terms(**SMALL, recompute=mode, dtype=torch.bfloat16)
    assert recompute.total(terms) == expect
    with pytest.raises(ValueError, match="for float32 only"):
        recompute.lab_terms(**SMALL, attention_impl="sdpa", dtype=torch.bfloat16)


def test_derived_cuda_constants_are_the_papers_but_for_an_fp32_softmax():
    cuda = recompute.formulas(2, 1, "explicit", 4)
    assert cuda["none, TP"] == "sbh(10 + 24/t + 7as/(ht))"
    assert recompute.formulas(2, 1, "sdpa")["none, TP+SP"] == "34sbh/t"
    s, b, h, a = SMALL.values()
    terms = recompute.lab_terms(**SMALL, dtype=torch.bfloat16, device="cuda")
    assert recompute.total(terms) == s * b * h * (34 + 7 * a * s // h) + s * s + 16 * s * b


def test_hand_worked_bytes_at_t1_explicit():
    # sbh = 16384, as/h = 16: (72 + 192) sbh + s^2 + 16sb; 72 sbh + 16sb; 4 sbh
    assert lab_formula(**SMALL) == 264 * 16384 + 16384 + 4096 == 4_345_856
    assert lab_formula(**SMALL, mode="selective") == 1_183_744
    assert lab_formula(**SMALL, mode="full") == 65_536


def test_gpt_model_keeps_l_layers_plus_what_lies_outside_them(world):
    s, b, h, a = SMALL.values()
    layers, vocab = 2, 256
    sbh, sb = s * b * h, s * b
    # outside the layers, by hand: ids 8bs + positions 8s, embedding dropout mask 4sbh, final
    # LayerNorm input 4sbh + statistics 8sb, output-layer input 4sbh, log-softmax 4sbV (fp32),
    # targets 8bs, nll's total weight 4
    outside = 16 * sb + 8 * s + 12 * sbh + 8 * sb + 4 * sb * vocab + 4
    assert recompute.total(recompute.gpt_outside_terms(s, b, h, vocab)) == outside
    for mode in ("none", "selective", "full"):
        saved = recompute.measure_gpt_saved_bytes(s, b, h, a, layers, vocab, mode)
        assert saved.bytes == layers * lab_formula(s, b, h, a, mode=mode) + outside, mode


# --------------------------------------------------------------------------- FLOPs
def test_hand_worked_step_flops_of_a_tiny_layer():
    # s=16 b=2 h=32: linear 24sbh^2 = 786432, core 4bs^2h = 65536, forward 851968
    expect = {"none": 3 * 851968, "selective": 3 * 851968 + 65536, "full": 4 * 851968}
    for mode, flops in expect.items():
        assert recompute.step_flops_formula(**TINY, recompute=mode)["step"] == flops
    assert recompute.step_flops_formula(**TINY, recompute="full", t=2)["step"] == 4 * 851968 // 2


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_flop_counter_finds_3_forwards_plus_the_recomputed_part(world, attention):
    expect = {"none": 2_555_904, "selective": 2_621_440, "full": 3_407_872}
    for mode, flops in expect.items():
        row = recompute.flops_row(**TINY, recompute=mode, attention_impl=attention)
        assert (row["counted"], row["formula"]) == (flops, flops), mode


def test_gpt_model_step_flops_equal_the_cost_models_and_the_papers_closed_forms(world):
    s, b, h, a = TINY.values()
    layers, vocab = 2, 128
    shape = ModelShape(num_layers=layers, hidden_size=h, num_attention_heads=a, seq_length=s,
                       vocab_size=vocab)
    for mode in ("none", "selective", "full"):
        counted = recompute.count_step_flops(s, b, h, a, mode, layers, vocab_size=vocab)["step"]
        assert counted == hardware_flops_per_iteration(shape, b, mode), mode
        if mode != "selective":     # Narayanan et al. 2021's 72 / 96 forms
            assert counted == paper_flops_per_iteration(shape, b, mode), mode
