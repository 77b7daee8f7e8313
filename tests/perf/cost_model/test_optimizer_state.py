"""Megatron's bytes per parameter (mpu_lab.perf.cost_model.optimizer_state) against the table of
Megatron-core's developer guide, "Distributed Optimizer", and the explorer's memory verdict
for one configuration worked by hand."""
import pytest
import torch

from mpu_lab.perf.cost_model import DGX_A100_80GB, ModelShape
from mpu_lab.perf import explorer
from mpu_lab.perf import memory_breakdown as perf_memory
from mpu_lab.perf.cost_model import bytes_per_parameter, bytes_per_parameter_terms, \
    format_bytes_per_parameter

# The guide's table, as printed there: (params, grads) -> (plain, (kept, split) of kept + split/d)
GUIDE = {("fp16", "fp16"): (20, (4, 16)), ("bf16", "fp32"): (18, (6, 12)),
         ("fp32", "fp32"): (16, (8, 8))}


@pytest.mark.parametrize("pair", list(GUIDE))
def test_the_six_figures_of_megatron_cores_distributed_optimizer_guide(pair):
    plain, (kept, split) = GUIDE[pair]
    assert bytes_per_parameter(*pair) == plain
    for d in (2, 4, 8, 64):
        assert bytes_per_parameter(*pair, distributed_optimizer=True,
                                   data_parallel_size=d) == pytest.approx(kept + split / d)


@pytest.mark.parametrize("pair", list(GUIDE))
def test_the_distributed_optimizer_at_d_1_is_the_plain_figure(pair):
    assert bytes_per_parameter(*pair, distributed_optimizer=True, data_parallel_size=1) == \
        bytes_per_parameter(*pair)
    # without the distributed optimizer d changes nothing
    assert bytes_per_parameter(*pair, data_parallel_size=8) == bytes_per_parameter(*pair)


def test_the_terms_are_what_megatron_keeps_and_what_it_shards():
    # the guide: fp32 params are not distributed again; gradients and params are never sharded
    assert bytes_per_parameter_terms("fp16", "fp16") == {
        "replicated": {"param": 2, "grad": 2},
        "sharded": {"fp32 main param": 4, "fp32 main grad": 4, "Adam m": 4, "Adam v": 4}}
    assert bytes_per_parameter_terms("bf16", "fp32") == {
        "replicated": {"param": 2, "grad": 4},
        "sharded": {"fp32 main param": 4, "Adam m": 4, "Adam v": 4}}
    assert bytes_per_parameter_terms("fp32", "fp32") == {
        "replicated": {"param": 4, "grad": 4}, "sharded": {"Adam m": 4, "Adam v": 4}}


def test_torch_dtypes_and_their_names_are_accepted_alike():
    assert bytes_per_parameter(torch.bfloat16, torch.float32) == 18
    assert bytes_per_parameter(torch.float16, torch.float16) == 20
    assert bytes_per_parameter("bfloat16", "float32") == 18
    assert bytes_per_parameter("HALF", "float16") == 20
    assert bytes_per_parameter("torch.float32", "float") == 16
    # the guide's "float16" means either 16-bit format: only the width counts
    assert bytes_per_parameter("bf16", "bf16") == 20
    assert bytes_per_parameter("fp16", "fp32") == 18


@pytest.mark.parametrize("params,grads,needle", [
    ("fp32", "bf16", "params_dtype 'fp32' with grads_dtype 'bf16' (fp32/bf16) is not a "
                     "combination"),
    ("fp16", "bf16", "valid params/grads: fp16/fp16, bf16/bf16, fp16/fp32, bf16/fp32, fp32/fp32"),
    ("int8", "fp32", "params_dtype 'int8' is not a dtype"),
    ("fp16", torch.float64, "grads_dtype torch.float64 is not a dtype"),
])
def test_a_bad_combination_names_the_values_and_the_valid_ones(params, grads, needle):
    with pytest.raises(ValueError) as err:
        bytes_per_parameter(params, grads)
    assert needle in str(err.value)


@pytest.mark.parametrize("d", [0, -1, 2.0, True])
def test_a_bad_data_parallel_size_is_refused(d):
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        bytes_per_parameter("fp32", "fp32", True, d)


def test_the_printed_table_holds_the_guides_figures():
    lines = format_bytes_per_parameter(data_parallel_size=4).splitlines()
    assert "at d = 4" in lines[0]
    rows = {line.split("  ")[0].strip(): line for line in lines[1:]}
    assert rows["fp16 / fp16"].split()[-3:] == ["+", "16/d", "8.00"] and " 20 " in rows["fp16 / fp16"]
    assert rows["bf16 / fp32"].split()[-3:] == ["+", "12/d", "9.00"] and " 18 " in rows["bf16 / fp32"]
    assert rows["fp32 / fp32"].split()[-3:] == ["+", "8/d", "10.00"] and " 16 " in rows["fp32 / fp32"]


def test_mpu_labs_own_figure_is_the_fp32_row_because_it_autocasts_over_fp32_weights():
    assert perf_memory.mpu_lab_bytes_per_parameter() == 16
    assert perf_memory.mpu_lab_bytes_per_parameter(True, 4) == 8 + 8 / 4
    assert (perf_memory.MPU_LAB_PARAMS_DTYPE, perf_memory.MPU_LAB_GRADS_DTYPE) == ("fp32", "fp32")


# --------------------------------------------------------------------------- the explorer
GPT3 = ModelShape(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048,
                  vocab_size=51200, name="GPT-3 175B")


def test_the_explorers_memory_verdict_for_one_configuration_worked_by_hand():
    # GPT-3 175B on 128 A100s (80 GB), B = 1536, t = 8, p = 4, d = 4, b = 4, the distributed
    # optimizer, selective recomputation and sequence parallelism (the explorer's defaults).
    result = explorer.explore(GPT3, DGX_A100_80GB.replace(num_nodes=16), num_gpus=128,
                              global_batch_size=1536, distributed_optimizer=True)
    cand = result.find(t=8, p=4, b=4)
    # Parameters of the first stage: 24 layers of 12h² + 13h split 8 ways, the word embedding
    # split 8 ways, the position embedding whole.
    h = 12288
    n = 24 * (12 * h * h + 13 * h) // 8 + 51200 * h // 8 + 2048 * h
    assert n == 5_540_106_240
    # Megatron's fp16/fp16 row with the distributed optimizer: 4 + 16/4 = 8 bytes per parameter
    states = 8 * n                                      # 44,320,849,920 bytes
    # Korthikanti Table 2, selective recomputation with SP: 34·s·b·h/t per layer and
    # micro-batch; 24 layers; 1F1B keeps min(p, m) = min(4, 1536/(4·4)) = 4 in flight
    activations = 34 * 2048 * 4 * h // 8 * 24 * 4       # 41,070,624,768 bytes
    total = states + activations
    assert total == 85_391_474_688
    assert cand.prediction.memory["total"] == pytest.approx(total, rel=1e-12)
    assert cand.fits is False and total > 80e9
    assert cand.reasons[0].startswith("does not fit: 85.4 GB per GPU needed, 80 GB available")
    # ZeRO's 2 + 2 + 12/d (16 bytes) would have said it fits: 4n + 3n + activations = 79.85 GB
    assert 7 * n + activations < 80e9
    assert "16-bit weights and activations (fp16), fp16 gradients: 20 bytes per parameter" \
        in " ".join(result.assumptions().split())


def test_the_explorer_counts_bf16_with_fp32_gradients_at_18_bytes():
    small = ModelShape(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=256,
                       vocab_size=1024)
    fp16 = explorer.explore(small, DGX_A100_80GB, 8, 32).find(t=2, p=1, b=1).prediction
    bf16 = explorer.explore(small, DGX_A100_80GB, 8, 32, params_dtype=torch.bfloat16,
                            grads_dtype="fp32").find(t=2, p=1, b=1).prediction
    n = fp16.memory["weights"] / 2
    assert fp16.memory["total"] - fp16.memory["activations"] == pytest.approx(20 * n)
    assert bf16.memory["total"] - bf16.memory["activations"] == pytest.approx(18 * n)
    with pytest.raises(ValueError, match="fp32/fp16"):
        explorer.explore(small, DGX_A100_80GB, 8, 32, params_dtype="fp32", grads_dtype="fp16")
