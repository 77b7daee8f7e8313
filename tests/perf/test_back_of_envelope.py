"""mpu_lab.perf.back_of_envelope: each dimension's FLOPs, bytes and intensity against values
worked by hand, and against the cost model's own byte counts and time prediction (a second
method)."""
import dataclasses

import pytest

from mpu_lab.perf import back_of_envelope as be
from mpu_lab.perf import explore
from mpu_lab.perf.cost_model import (DGX_A100_80GB, DGX_H100, GPT3_175B, ModelShape,
                                     ParallelConfig, cp_comm_bytes_per_layer,
                                     dp_allreduce_bytes, flops_per_token,
                                     moe_a2a_bytes_per_layer, parameters_per_gpu,
                                     pipeline_p2p_bytes, predict_iteration, ring_overlap,
                                     tp_comm_per_layer)


# ------------------------------------------------------------------ worked by hand
def test_ridge_and_roofline_of_an_h100_by_hand():
    # 989 TFLOP/s over 450 GB/s NVLink, 50 GB/s InfiniBand, 3.35 TB/s HBM
    assert be.ridge(989e12, 450e9) == pytest.approx(2197.78, abs=0.01)
    assert be.ridge(989e12, 50e9) == pytest.approx(19780.0)
    assert be.ridge(989e12, 3.35e12) == pytest.approx(295.22, abs=0.01)
    assert be.roofline(100.0, 989e12, 3.35e12) == pytest.approx(335e12)    # on the slope
    assert be.roofline(1000.0, 989e12, 3.35e12) == 989e12                 # on the flat


def test_matmul_intensity_by_hand():
    assert be.matmul_intensity(2, 2, 2) == pytest.approx(16 / 24)         # 2·8 / (2·12)
    assert be.matmul_intensity(4096, 4096, 4096) == pytest.approx(4096 / 3)
    assert be.matmul_intensity(1, 4096, 4096, dtype_bytes=2) == pytest.approx(
        2 * 4096 * 4096 / (2 * (4096 + 4096 * 4096 + 4096)))


def test_tensor_parallel_by_hand():
    tp = be.tensor_parallel(h=1024, tokens=8, t=4)
    assert tp.flops == 150_994_944          # 72 · 8 · 1024² / 4
    assert tp.bytes == 98_304               # 4 · 2·3/4 · 8 · 1024 · 2
    assert tp.intensity == 1536             # 9 · 1024 / (3 · 2)
    # t = 8 on an H100's NVLink: comm-bound below h = 7 · 2 · ridge / 9
    t8 = be.tensor_parallel(h=4096, tokens=2048, t=8)
    assert t8.critical(989e12, 450e9) == pytest.approx(7 * 2 * (989e12 / 450e9) / 9)
    assert t8.bound(989e12, 450e9) == "compute-bound"            # 9·4096/14 = 2633 > 2198
    assert t8.bound(989e12, 50e9) == "communication-bound"
    assert be.tensor_parallel(h=64, tokens=8, t=1).intensity == float("inf")


def test_data_parallel_by_hand():
    dp = be.data_parallel(params=1e6, tokens=1000, d=4)
    assert dp.flops == 6e9 and dp.bytes == 3e6 and dp.intensity == 2000   # 3·1000·4/(3·2)
    assert dp.critical(989e12, 50e9) == pytest.approx(3 / 4 * 2 * 19780 / 3)


def test_pipeline_parallel_by_hand():
    pp = be.pipeline_parallel(h=256, tokens=64, layers=4, t=2)
    assert pp.flops == 603_979_776 and pp.bytes == 32_768 and pp.intensity == 18_432


def test_context_parallel_by_hand():
    cp = be.context_parallel(h=64, seq_length=1024, b=2, c=4)
    assert cp.flops == 50_331_648           # 6 · 256² · 2 · 64
    assert cp.bytes == 393_216              # 6 · 256 · 2 · 64 · 2
    assert cp.intensity == 128              # 256 / 2
    assert cp.critical(989e12, 450e9) == pytest.approx(2 * 989e12 / 450e9)


def test_expert_parallel_by_hand():
    ep = be.expert_parallel(h=128, tokens=32, ffn=512, k=2, e=4)
    assert ep.flops == 75_497_472           # 6 · 2 · 3 · 128 · 512 · 32
    assert ep.bytes == 49_152               # 4 · 32 · 2 · 128 · 2 · 3/4
    assert ep.intensity == 1536             # 4.5 · 512 · 4 / (3 · 2)
    assert be.expert_parallel(h=128, tokens=32, ffn=512, k=2, e=4, gated=False).intensity \
        == 1024


@pytest.mark.parametrize("call, words", [
    (lambda: be.tensor_parallel(h=0, tokens=8, t=2), "h must be a positive integer, got 0"),
    (lambda: be.data_parallel(params=1e6, tokens=10, d=2.5), "d must be a positive integer"),
    (lambda: be.context_parallel(h=64, seq_length=1000, b=1, c=3), "c = 3 must divide"),
    (lambda: be.ridge(989e12, 0), "bandwidth must be a positive number, got 0"),
])
def test_bad_input_is_refused_naming_the_value(call, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        call()


# ------------------------------------------------------------------ the cost model, a second method
SMALL = ModelShape(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=512,
                   vocab_size=8)


def test_tp_bytes_and_flops_equal_the_cost_models():
    cfg = ParallelConfig(tp=4, pp=2, dp=1, micro_batch_size=2, global_batch_size=8)
    tokens = 2 * SMALL.s
    tp = be.tensor_parallel(SMALL.h, tokens, 4, seq_length=SMALL.s)
    assert tp.bytes == pytest.approx(tp_comm_per_layer(SMALL, cfg)["bytes"])
    assert tp.flops == pytest.approx(3 * tokens * flops_per_token(SMALL)["layer"] / 4)


def test_tp_comm_over_compute_equals_the_predicted_iterations_share():
    """predict_iteration at zero latency, no elementwise term: its TP time over its matmul time
    is the back-of-envelope's comm/compute at the same effective rates (the vocabulary's tiny
    all-reduces and V = 8 logits are the only difference)."""
    cluster = DGX_H100.replace(latency_s=0.0)
    for t in (2, 8):
        cfg = ParallelConfig(tp=t, pp=2, dp=1, micro_batch_size=1, global_batch_size=4)
        pred = predict_iteration(SMALL, cfg, cluster, ignore=("elementwise",))
        tp = be.tensor_parallel(SMALL.h, SMALL.s, t, seq_length=SMALL.s)
        rate = cluster.peak_flops * cluster.matmul_efficiency
        link = cluster.intra_node_bandwidth * cluster.bandwidth_efficiency
        assert tp.comm_s(link) / tp.compute_s(rate) == pytest.approx(
            pred.tp_comm_s / pred.matmul_s, rel=2e-3)


def test_dp_and_pp_bytes_equal_the_cost_models():
    cfg = ParallelConfig(tp=2, pp=2, dp=4, micro_batch_size=1, global_batch_size=16)
    params = parameters_per_gpu(SMALL, cfg)
    dp = be.data_parallel(params, tokens=4 * SMALL.s, d=4)
    assert dp.bytes == pytest.approx(dp_allreduce_bytes(SMALL, cfg))
    pp = be.pipeline_parallel(SMALL.h, SMALL.s, layers=2, t=2)
    assert pp.bytes == pytest.approx(2 * pipeline_p2p_bytes(SMALL, cfg))    # out and back


def test_cp_bytes_and_threshold_equal_the_cost_models_ring():
    s, b, h, c, t = 32768, 1, 12288, 4, 8
    cp = be.context_parallel(h, s, b, c, t)
    assert (c - 1) * cp.bytes == pytest.approx(
        cp_comm_bytes_per_layer(s, b, h, c, "p2p", 2, t)["total"])
    ring = ring_overlap(s, b, h, c, DGX_H100, crosses_nodes=True, t=t)
    rate = DGX_H100.peak_flops * DGX_H100.matmul_efficiency
    link = DGX_H100.inter_node_bandwidth * DGX_H100.bandwidth_efficiency
    assert cp.critical(rate, link) == pytest.approx(ring["min_tokens_per_rank"])
    assert (cp.bound(rate, link) == "compute-bound") == ring["hidden"]
    # the ring step's transfer and compute are the cost model's, up to fwd+bwd = 3 x fwd
    assert cp.comm_s(link) == pytest.approx(3 * ring["transfer_s"])
    assert cp.compute_s(rate) == pytest.approx(3 * ring["compute_s"])


def test_ep_bytes_equal_the_cost_models():
    ep = be.expert_parallel(h=4096, tokens=4096, ffn=14336, k=2, e=8)
    assert ep.bytes == pytest.approx(moe_a2a_bytes_per_layer(4096, 4096, 2, 8)["total"])


def test_the_envelope_and_the_explorer_agree_on_t_32_for_gpt3():
    """Why the explorer flags t = 32: GPT-3's TP at t = 32 falls below InfiniBand's ridge (the
    envelope), and the explorer puts most of that configuration's time on TP, flagged."""
    cluster = DGX_A100_80GB.replace(num_nodes=16)
    gpt3 = dataclasses.replace(GPT3_175B, vocab_size=51200)
    worst = explore(gpt3, cluster, num_gpus=128, global_batch_size=1536).find(32, 4, b=8)
    assert "TP>node" in worst.short_flags()
    tp = be.tensor_parallel(gpt3.h, 8 * gpt3.s, 32)
    assert tp.bound(cluster.peak_flops, cluster.inter_node_bandwidth) == "communication-bound"
    share = worst.prediction.shares()["tp_comm"]
    rate = cluster.peak_flops * cluster.matmul_efficiency
    link = cluster.inter_node_bandwidth * cluster.bandwidth_efficiency
    ratio = tp.comm_s(link) / tp.compute_s(rate)
    assert share > 0.5 and ratio / (1 + ratio) == pytest.approx(share, abs=0.1)


def test_tables_print_the_ridges_and_a_row_per_case():
    cases = [be.tensor_parallel(12288, 2048, 8), be.context_parallel(12288, 32768, 1, 4, 8)]
    text = be.format_strategies(cases, DGX_H100)
    assert "NVLink 2,198" in text and "InfiniBand 19,780" in text
    assert len(text.splitlines()) == 4 + len(cases)          # a ridge line, two headers, knobs
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "9h / ((t−1)·B)" in be.format_formulas(cases)
    mm = be.format_matmuls([(1, 4096, 4096), (4096, 4096, 4096)], 989e12, 3.35e12)
    assert "memory-bound" in mm and "compute-bound" in mm


def test_comm_share_and_a_custom_link_by_hand():
    tp = be.tensor_parallel(h=1024, tokens=8, t=4)           # intensity 1536
    # ridge 3072 -> r = 2, share 2/3
    assert tp.comm_share(3072e9, 1e9) == pytest.approx(2 / 3)
    text = be.format_strategies([tp], links={"gloo": 1e9}, peak_flops=3072e9, name="here")
    assert text.startswith("here:") and "gloo 3,072" in text and "| communication " in text


def test_tp_sizes_table_by_hand():
    text = be.format_tp_sizes(12288, 2048, (2, 32), DGX_H100).splitlines()
    # t = 2: 9·12288/2 = 55,296 FLOP/B; r = 2,197.8/55,296 = 0.0397 on NVLink -> 4 %;
    # on InfiniBand r = 0.358 -> 26 %. t = 32 does not fit a node of 8.
    assert text[2].split() == ["2", "55,296", "4%", "26%"]
    assert text[3].split()[:3] == ["32", "1,784", "(>"]
