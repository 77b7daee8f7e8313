"""Context parallelism in the cost model (mpu_lab.perf.cost_model.context) and the explorer's
32k-sequence example, against numbers worked by hand here and against the dense cost model at
cp = 1."""
import dataclasses

import pytest

from mpu_lab.perf.cost_model import DGX_H100, GPT3_175B, ParallelConfig
from mpu_lab.perf import explorer
from mpu_lab.perf.cost_model import (activation_memory_per_layer, cp_activation_memory_per_layer,
                                     cp_comm_bytes_per_layer, cp_memory_per_gpu, memory_per_gpu,
                                     predict_context_parallel, predict_iteration, ring_overlap)

GPT3_32K = dataclasses.replace(GPT3_175B, seq_length=32768)


def test_activations_of_a_tiny_layer_by_hand():
    # s 16, b 1, h 4, a 2, cp 2: each rank keeps 8 tokens. The s·b·h terms: 34 · 8 · 1 · 4 =
    # 1,088 bytes; the scores are the rank's 8 queries against all 16 keys: 5 · 2 · 8 · 16 =
    # 1,280 bytes (not 5 · 2 · 8 · 8 = 640, a q-chunk against a k-chunk). Total 2,368.
    assert cp_activation_memory_per_layer(16, 1, 4, 2, cp=2) == 2368
    # the whole sequence on one rank: 34 · 64 + 5 · 2 · 16 · 16 = 2,176 + 2,560 = 4,736 = 2 x
    assert activation_memory_per_layer(16, 1, 4, 2) == 4736


def test_activations_of_gpt3_at_32k_by_hand():
    # s 32768, h 12288, a 96, t 8 with SP, cp 4 (Korthikanti Table 2, s -> s/cp):
    # s·b·h/t = 32768 · 12288 / 8 = 50,331,648; 34 + 5as/h = 34 + 5 · 96 · 32768 / 12288
    # = 34 + 1280 = 1314; 50,331,648 · 1314 / 4 = 16,533,946,368 bytes.
    assert cp_activation_memory_per_layer(32768, 1, 12288, 96, 8, True, 4) == 16_533_946_368


def test_ring_and_collective_bytes_per_layer_by_hand():
    # one K (or V) block of GPT-3 at 32k on one rank of t = 8, cp = 4, 16-bit:
    # (32768 / 4) · 1 · 12288 · 2 / 8 = 25,165,824 bytes
    block = 25_165_824
    p2p = cp_comm_bytes_per_layer(32768, 1, 12288, 4, "p2p", 2, 8)
    assert p2p["forward"] == 2 * 3 * block == 150_994_944       # K and V, cp - 1 = 3 steps
    assert p2p["backward"] == 4 * 3 * block == 301_989_888      # K, V again + dK, dV back
    a2a = cp_comm_bytes_per_layer(32768, 1, 12288, 4, "a2a", 2, 8)
    assert a2a["forward"] == a2a["backward"] == 4 * 3 / 4 * block == 75_497_472
    ag = cp_comm_bytes_per_layer(32768, 1, 12288, 4, "allgather", 2, 8)
    assert ag["forward"] == ag["backward"] == 150_994_944
    assert cp_comm_bytes_per_layer(32768, 1, 12288, 1, "p2p")["total"] == 0


def test_the_ring_hides_inside_a_node_but_not_across_nodes():
    # H100 matmuls at 989e12 · 0.51 = 504.39e12 FLOP/s; NVLink 450e9 · 0.8 = 360e9 B/s; the
    # network 50e9 · 0.8 = 40e9 B/s. Half a block pair (4 (s/cp)² b h / t · 1/2) against one
    # K and V block (2 (s/cp) b h B / t): hidden when s/cp >= rate · B / bandwidth,
    # 504.39e12 · 2 / 360e9 = 2,802.2 tokens inside a node, / 40e9 = 25,219.5 across nodes.
    inside = ring_overlap(32768, 1, 12288, 4, DGX_H100, crosses_nodes=False, t=8)
    across = ring_overlap(32768, 1, 12288, 4, DGX_H100, crosses_nodes=True, t=8)
    assert inside["min_tokens_per_rank"] == pytest.approx(2802.1667, rel=1e-6)
    assert across["min_tokens_per_rank"] == pytest.approx(25219.5, rel=1e-6)
    assert inside["hidden"] and inside["exposed_s"] == 0        # 8,192 tokens per rank
    assert not across["hidden"] and across["exposed_s"] > 0


def test_cp_1_is_the_dense_cost_model():
    cfg = ParallelConfig(tp=8, pp=4, dp=4, global_batch_size=64, sequence_parallel=True,
                         recompute="selective", distributed_optimizer=True)
    assert cp_memory_per_gpu(GPT3_32K, cfg, 1) == memory_per_gpu(GPT3_32K, cfg)
    assert predict_context_parallel(GPT3_32K, cfg, 1, DGX_H100).total_s == \
        predict_iteration(GPT3_32K, cfg, DGX_H100).total_s


def test_the_worked_example_memory_by_hand():
    # t 8, p 4, d 4, cp 4, b 1, B 64: selective recomputation keeps 34 · (s/cp) · b · h / t
    # = 34 · 8192 · 12288 / 8 = 427,819,008 bytes per layer; 96 / 4 = 24 layers on stage 0;
    # m = 64 / 4 = 16 micro-batches, so 1F1B holds p = 4 in flight: 41,070,624,768 bytes.
    cfg = ParallelConfig(tp=8, pp=4, dp=4, global_batch_size=64, sequence_parallel=True,
                         recompute="selective", distributed_optimizer=True)
    mem = cp_memory_per_gpu(GPT3_32K, cfg, 4)
    assert mem["activations"] == 41_070_624_768
    # weights and gradients are those of the same split without CP (CP leaves weights whole)
    assert mem["weights"] == memory_per_gpu(GPT3_32K, cfg)["weights"]


def test_long_sequence_example_cp_is_what_makes_it_fit():
    ex = explorer.long_sequence_example()
    # cp = 1: even at t = 8 (the largest TP inside a DGX), whatever p, stage 0 keeps
    # 34 · s · h · L / t = 34 · 32768 · 12288 · 96 / 8 = 164.3 GB of activations > 80 GB.
    assert 34 * 32768 * 12288 * 96 / 8 > 80e9
    assert ex["verdict"][1] == "does not fit"
    assert ex["verdict"][4] == "fits"
    best = ex["ranking"][0]
    assert best.fits and best.cp > 1 and best.num_gpus == 512
    assert {r.cp for r in ex["ranking"]} == {1, 2, 4, 8}
    assert "cp=1: does not fit" in ex["table"] and "cp=4: fits" in ex["table"]


@pytest.mark.parametrize("cp, comm, match", [(3, "p2p", "2\\*cp = 6"),
                                             (4, "a2a", "t\\*cp = 32"),
                                             (2, "ring", "comm_type must be one of")])
def test_bad_context_parallel_inputs_are_refused(cp, comm, match):
    model = dataclasses.replace(GPT3_32K, seq_length=32764 if cp == 3 else 32768,
                                num_attention_heads=96 if cp != 4 else 48)
    cfg = ParallelConfig(tp=8, pp=1, dp=1)
    with pytest.raises(ValueError, match=match):
        predict_context_parallel(model, cfg, cp, DGX_H100, comm_type=comm)
