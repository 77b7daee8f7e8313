"""The cost model's recomputation (Korthikanti et al. 2022 §5; Megatron-core's recompute_method
"block" with recompute_num_layers): memory and FLOPs per mode, worked by hand for a tiny GPT."""
import pytest

from mpu_lab.perf.cost_model import (DGX_A100_80GB, ModelShape, ParallelConfig,
                                     hardware_flops_per_iteration, memory_per_gpu,
                                     model_flops_per_iteration, predict_iteration,
                                     tp_comm_per_layer)
from mpu_lab.perf.cost_model.counts import recomputed_share

# L = 4, s = 128, b = 2, h = 64, a = 8: sbh = 16384, 5as/h = 80
TINY = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=128,
                  vocab_size=256)
WHOLE, SELECTIVE, INPUT = 16384 * 114, 16384 * 34, 16384 * 2     # bf16 bytes per layer


def cfg(**kw):
    return ParallelConfig(micro_batch_size=2, global_batch_size=2, **kw)


def test_hand_worked_activation_bytes_per_mode():
    assert WHOLE == 1_867_776 and SELECTIVE == 557_056 and INPUT == 32_768
    act = {mode: memory_per_gpu(TINY, cfg(recompute=mode))["activations"]
           for mode in ("none", "selective", "full")}
    assert act == {"none": 4 * 1_867_776, "selective": 4 * 557_056,
                   "full": 4 * 32_768 + 1_867_776}           # + the layer being recomputed


@pytest.mark.parametrize("n,expect", [(1, 32_768 + 3 * 1_867_776), (2, 2 * 32_768 + 2 * 1_867_776),
                                      (3, 3 * 32_768 + 1_867_776), (4, 4 * 32_768 + 1_867_776)])
def test_block_method_keeps_the_input_of_n_layers_and_everything_of_the_rest(n, expect):
    """Megatron-core's recompute_method="block": the first n of 4 layers keep their input only.
    Below n = 4 the later layers' activations are freed before the first n are recomputed, so
    the peak is what the forward kept; n = 3 needs less than recomputing all 4."""
    mem = memory_per_gpu(TINY, cfg(recompute="full", recompute_num_layers=n))
    assert mem["activations"] == expect
    assert recomputed_share(TINY, cfg(recompute="full", recompute_num_layers=n)) == n / 4


def test_recomputed_flops_per_mode_and_for_the_block_method():
    # per token: a layer 24h^2 + 4sh = 131072, the attention core 4sh = 32768, logits 2hV;
    # B s = 256 tokens
    model = model_flops_per_iteration(TINY, 2)
    assert model == 3 * 256 * (4 * 131_072 + 2 * 64 * 256) == 427_819_008
    assert hardware_flops_per_iteration(TINY, 2, "selective") - model == 256 * 4 * 32_768
    assert hardware_flops_per_iteration(TINY, 2, "full") - model == 256 * 4 * 131_072
    assert hardware_flops_per_iteration(TINY, 2, "full", 0.25) - model == 256 * 131_072
    pred = predict_iteration(TINY, cfg(recompute="full", recompute_num_layers=1), DGX_A100_80GB)
    assert pred.hardware_flops - pred.model_flops == 256 * 131_072
    with pytest.raises(ValueError, match="recomputed_share must be in"):
        hardware_flops_per_iteration(TINY, 2, "full", 1.5)


def test_block_method_recomputes_the_forward_collectives_of_its_layers_only():
    assert tp_comm_per_layer(TINY, cfg(tp=2, recompute="full"))["count"] == 6
    assert tp_comm_per_layer(TINY, cfg(tp=2, recompute="full", recompute_num_layers=1))["count"] \
        == 4 + 2 * 1 / 4


def test_more_recomputation_is_slower_and_smaller():
    times, memory = [], []
    for kw in (dict(recompute="none"), dict(recompute="selective"),
               dict(recompute="full", recompute_num_layers=2), dict(recompute="full")):
        pred = predict_iteration(TINY, cfg(**kw), DGX_A100_80GB)
        times.append(pred.total_s)
        memory.append(pred.memory["activations"])
    none, selective, block, full = times
    assert none < selective and none < block < full      # extra forward FLOPs and passes
    assert memory[0] > memory[1] and memory[0] > memory[2] > memory[3]


def test_recompute_num_layers_is_refused_where_megatron_refuses_it():
    with pytest.raises(ValueError, match="recompute_num_layers 2 needs recompute 'full'"):
        cfg(recompute="selective", recompute_num_layers=2).check(TINY)
    with pytest.raises(ValueError, match="recompute_num_layers 3 is more than the 2 layers of a "
                                         "model chunk"):
        ParallelConfig(pp=2, global_batch_size=2, recompute="full",
                       recompute_num_layers=3).check(TINY)
    with pytest.raises(ValueError, match="recompute_num_layers must be a positive integer"):
        cfg(recompute="full", recompute_num_layers=0).check(TINY)


# --------------------------------------------------------------------------- picking a mode
# fp16 weights and gradients, 20 bytes per parameter: 4 layers x (12h^2 + 13h) + (V + s) h
# = 224,512 parameters, 4,490,240 bytes; plus the activations worked out above
STATES = 20 * (4 * (12 * 64 * 64 + 13 * 64) + (256 + 128) * 64)


@pytest.mark.parametrize("memory,label,fits", [
    (12.0e6, "none", True),           # none needs 11,961,344
    (6.6e6, "full:3", True),          # only block n = 3 (6,456,320) and full (6,489,088) fit:
    (6.47e6, "full:3", True),         # n = 3 recomputes one layer fewer; then n = 3 alone
    (6.0e6, "full:3", False),         # nothing fits: the least memory, block n = 3
])
def test_pick_recompute_takes_the_fastest_mode_that_fits(memory, label, fits):
    from mpu_lab.perf.cost_model.predict import pick_recompute, recompute_label
    assert STATES == 4_490_240
    assert STATES + 4 * 1_867_776 == 11_961_344 and STATES + 3 * 32_768 + 1_867_776 == 6_456_320
    cluster = DGX_A100_80GB.replace(memory_bytes=memory)
    pred = pick_recompute(TINY, cfg(), cluster)
    assert (recompute_label(pred.config), pred.fits) == (label, fits)


def test_context_and_expert_parallel_memory_follow_the_block_method():
    """Under CP and EP the block method keeps the input of the first N layers of a stage and
    everything of the others, as the dense model does (above): N = all layers is full
    recomputation, and each layer taken out of the block adds back the difference between a
    whole layer and its input, the same amount for each."""
    from mpu_lab.perf.cost_model import ModelShape
    from mpu_lab.perf.cost_model.context import cp_memory_per_gpu
    from mpu_lab.perf.cost_model.moe import MoEModelShape, moe_memory_per_gpu
    dense = ModelShape(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=512,
                       vocab_size=1024)
    moe = MoEModelShape(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=512,
                        vocab_size=1024, ffn_hidden_size=512, num_experts=4, top_k=2)

    def acts(memory, **kw):
        full = memory(recompute="full")["activations"]
        block = [memory(recompute="full", recompute_num_layers=n)["activations"]
                 for n in range(1, 9)]
        none = memory(recompute="none")["activations"]
        return full, block, none

    for memory in (lambda **kw: cp_memory_per_gpu(dense, cfg(tp=2, **kw), cp=2),
                   lambda **kw: moe_memory_per_gpu(moe, ParallelConfig(
                       tp=2, dp=2, micro_batch_size=2, global_batch_size=4, **kw), ep=2)):
        full, block, none = acts(memory)
        assert block[-1] == pytest.approx(full, rel=1e-12)
        steps = [block[i] - block[i + 1] for i in range(6)]       # N = 1..7: no extra layer
        assert all(st == pytest.approx(steps[0], rel=1e-9) and st > 0 for st in steps)
        assert block[0] < none and block[0] == pytest.approx(none - steps[0], rel=1e-9)


def test_megatron_fsdp_strategies_divide_what_zero_says_and_zero3_moves_half_as_much_again():
    """ZeRO's stages (Rajbhandari et al. 2020 Fig. 1) for the tiny GPT at d = 4 in fp32
    (4 + 4 + 8 bytes per parameter): the optimizer states, then the gradients, then the
    weights fall to a quarter; ZeRO-3's bytes per step are 1.5 x the all-reduce's (§7.2.2)."""
    from mpu_lab.perf.cost_model.counts import dp_allreduce_bytes, parameters_per_gpu
    n = parameters_per_gpu(TINY, ParallelConfig(dp=4, micro_batch_size=2, global_batch_size=8),
                           "first")

    def mem(strategy, **kw):
        c = ParallelConfig(dp=4, micro_batch_size=2, global_batch_size=8,
                           data_parallel_sharding_strategy=strategy, **kw)
        assert c.problems(TINY) == []
        return memory_per_gpu(TINY, c, dtype_bytes=4)

    assert [(m["weights"], m["gradients"], m["optimizer"])
            for m in map(mem, ("no_shard", "optim", "optim_grads", "optim_grads_params"))] == [
        (4 * n, 4 * n, 8 * n), (4 * n, 4 * n, 2 * n), (4 * n, n, 2 * n), (n, n, 2 * n)]
    assert mem("optim") == mem(None, distributed_optimizer=True)      # the same ZeRO-1
    assert mem("no_shard") == mem(None)
    base = ParallelConfig(dp=4, micro_batch_size=2, global_batch_size=8)
    zero3 = ParallelConfig(dp=4, micro_batch_size=2, global_batch_size=8,
                           data_parallel_sharding_strategy="optim_grads_params")
    assert dp_allreduce_bytes(TINY, zero3, 4) == 1.5 * dp_allreduce_bytes(TINY, base, 4)
    bad = ParallelConfig(dp=4, micro_batch_size=2, global_batch_size=8, distributed_optimizer=True,
                         data_parallel_sharding_strategy="optim")
    assert any("shards the optimizer states itself" in p for p in bad.problems(TINY))
    typo = ParallelConfig(dp=4, micro_batch_size=2, global_batch_size=8,
                          data_parallel_sharding_strategy="zero3")
    assert any("must be one of no_shard, optim" in p for p in typo.problems(TINY))
