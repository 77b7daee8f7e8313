"""Mixture of experts in the cost model (mpu_lab.perf.cost_model.moe) and the explorer's
Mixtral 8x7B ranking, against Mistral AI's published parameter counts and numbers worked by
hand here."""
import dataclasses

import pytest

from mpu_lab.perf.cost_model import DGX_H100, ParallelConfig
from mpu_lab.perf import explorer
from mpu_lab.perf.cost_model import (MIXTRAL_8X7B, MoEModelShape, moe_a2a_bytes_per_layer,
                                     moe_flops_per_token, moe_memory_per_gpu,
                                     moe_parameter_count, predict_moe)

# Mixtral 8x7B (Jiang et al. 2024, Table 1): h 4096, ffn 14336, 32 heads of 128, 8 KV heads.
ATTENTION = 2 * 4096 * 4096 + 2 * 4096 * 1024      # q, out: h x h; k, v: h x 1024
assert ATTENTION == 41_943_040
EXPERT = 3 * 4096 * 14336                           # SwiGLU: gate, up, down
assert EXPERT == 176_160_768
ROUTER, NORMS = 4096 * 8, 2 * 4096                  # 32,768 and 8,192
EMBEDDINGS = 2 * 32000 * 4096 + 4096                # untied input and output, final norm


def test_mixtral_total_and_active_parameters_against_mistrals_figures():
    n = moe_parameter_count(MIXTRAL_8X7B)
    # by hand: 32 · (41,943,040 + 8 · 176,160,768 + 32,768 + 8,192) + 262,148,096
    total = 32 * (ATTENTION + 8 * EXPERT + ROUTER + NORMS) + EMBEDDINGS
    active = 32 * (ATTENTION + 2 * EXPERT + ROUTER + NORMS) + EMBEDDINGS
    assert total == 46_702_792_704 and active == 12_879_925_248
    assert n["total"] == total and n["active"] == active
    # Mistral AI, "Mixtral of experts" (11 Dec 2023): "46.7B total parameters", "12.9B
    # parameters per token". Mixtral has no biases and RMSNorm weights only, so nothing is left
    # out: the tolerance is the rounding of the published figures to 0.1 B (0.5 %).
    assert n["total"] == pytest.approx(46.7e9, rel=0.005)
    assert n["active"] == pytest.approx(12.9e9, rel=0.005)


def test_mixtral_flops_per_token_by_hand():
    # forward: 2 per weight a token meets (attention, 2 experts, router) + the attention core
    # 4 · s · h over all 32 query heads; logits 2 · h · V.
    layer = 2 * (ATTENTION + 2 * EXPERT + ROUTER) + 4 * 4096 * 4096
    assert layer == 855_703_552
    f = moe_flops_per_token(MIXTRAL_8X7B)
    assert f["layer"] == layer
    assert f["total"] == 32 * layer + 2 * 4096 * 32000 == 27_644_657_664


def test_experts_count_e_times_in_parameters_and_k_times_in_flops():
    one = dataclasses.replace(MIXTRAL_8X7B, num_experts=1, top_k=1)
    more = dataclasses.replace(MIXTRAL_8X7B, num_experts=16, top_k=1)
    assert moe_flops_per_token(more)["total"] - moe_flops_per_token(one)["total"] == \
        32 * 2 * (15 * 4096)                         # only the router grows
    assert moe_parameter_count(more)["experts"] == 16 * moe_parameter_count(one)["experts"]


def test_all_to_all_bytes_per_layer_by_hand():
    # 4096 tokens on a rank, top 2, h 4096, 16-bit, ep 8: each of dispatch and combine sends
    # 4096 · 2 · 4096 · 2 · 7/8 = 58,720,256 bytes; forward and backward: 4 of them.
    a2a = moe_a2a_bytes_per_layer(4096, 4096, 2, 8)
    assert a2a["dispatch"] == a2a["combine"] == 58_720_256
    assert a2a["total"] == 234_881_024
    assert moe_a2a_bytes_per_layer(4096, 4096, 2, 1)["total"] == 0


def test_memory_per_rank_with_ep_by_hand():
    # t 1, p 1, d 8, ep 8 (one expert per rank), fp16 weights and gradients:
    # dense = 32 · (attention + router + norms) + 2 · V · h (untied, p = 1)
    #       = 32 · 41,984,000 + 262,144,000 = 1,605,632,000
    # experts = 32 · 8 · 176,160,768 / 8 = 5,637,144,576
    dense, experts = 1_605_632_000, 5_637_144_576
    assert 32 * (ATTENTION + ROUTER + NORMS) + 2 * 32000 * 4096 == dense
    cfg = ParallelConfig(tp=1, pp=1, dp=8, global_batch_size=8, distributed_optimizer=True)
    mem = moe_memory_per_gpu(MIXTRAL_8X7B, cfg, ep=8)
    assert mem["weights"] == mem["gradients"] == 2 * (dense + experts)
    # the distributed optimizer's 16 bytes shard the dense parameters over d = 8, the experts
    # over the expert data-parallel group t · d / ep = 1: they are not sharded at all
    assert mem["optimizer"] == 16 * (dense / 8 + experts) == 93_405_577_216
    # at ep = 1 every rank holds all 8 experts, and shards their Adam states 8 ways
    mem1 = moe_memory_per_gpu(MIXTRAL_8X7B, cfg, ep=1)
    assert mem1["weights"] == 2 * (dense + 8 * experts)
    assert mem1["optimizer"] == pytest.approx(16 * (dense + 8 * experts) / 8)


def test_moe_example_ranks_t_p_d_ep_for_mixtral():
    ex = explorer.moe_example()
    ranking = ex["ranking"]
    assert ex["model"] is MIXTRAL_8X7B
    assert ranking[0].fits
    for r in ranking:
        c = r.config
        assert c.tp * c.pp * c.dp == 64 and 8 % r.ep == 0 and (c.tp * c.dp) % r.ep == 0
        assert c.tp <= 8
    assert {r.ep for r in ranking} == {1, 2, 4, 8}
    assert any(not r.fits for r in ranking)
    assert "Mixtral 8x7B on 64 GPUs" in ex["table"]


@pytest.mark.parametrize("ep, tp, dp, match", [(3, 1, 6, "does not divide num_experts 8"),
                                               (8, 1, 4, "does not divide t\\*d = 4")])
def test_bad_expert_parallel_sizes_are_refused(ep, tp, dp, match):
    cfg = ParallelConfig(tp=tp, pp=1, dp=dp, global_batch_size=dp)
    with pytest.raises(ValueError, match=match):
        predict_moe(MIXTRAL_8X7B, cfg, ep, DGX_H100)


def test_top_k_above_the_experts_is_refused():
    with pytest.raises(ValueError, match="top_k 3 is more than num_experts 2"):
        MoEModelShape(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4,
                      vocab_size=16, ffn_hidden_size=16, num_experts=2, top_k=3)


def test_recomputation_modes_change_the_activations_by_the_terms_worked_by_hand():
    # t 2 with SP, p 2, d 16, B 256: m = 16, so stage 0 holds p = 2 micro-batches of its 16
    # layers. Keeping the scores adds 5 · a · s² · b / t = 5 · 32 · 4096² / 2 = 1,342,177,280
    # bytes per layer: 1,342,177,280 · 16 · 2 = 42,949,672,960 bytes.
    def act(recompute):
        cfg = ParallelConfig(tp=2, pp=2, dp=16, global_batch_size=256, sequence_parallel=True,
                             recompute=recompute, distributed_optimizer=True)
        return moe_memory_per_gpu(MIXTRAL_8X7B, cfg, ep=8)["activations"]
    assert act("none") - act("selective") == 42_949_672_960
    # full recomputation keeps each layer's input, 2 · s · b · h / t = 16,777,216 bytes, for
    # 16 layers x 2 micro-batches (536,870,912), plus one selective layer live at a time
    assert act("full") == pytest.approx(536_870_912 + act("selective") / (16 * 2), rel=1e-12)
