"""The explorer picks a recomputation (explore(recompute="auto")): for each split the fastest
mode that fits (mpu_lab.perf.cost_model.predict.pick_recompute, worked by hand in
tests/perf/cost_model/test_cost_model_recompute.py)."""
import pytest

from mpu_lab.perf import explore
from mpu_lab.perf.cost_model import DGX_A100_80GB, GPT3_175B, ModelShape

TINY = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=128,
                  vocab_size=256)


def test_auto_picks_block_recomputation_when_only_it_fits_and_the_table_says_so():
    result = explore(TINY, DGX_A100_80GB.replace(memory_bytes=6.47e6), num_gpus=1,
                     global_batch_size=2, micro_batch_sizes=(2,), recompute="auto")
    assert [c.record()["recompute"] for c in result.candidates] == ["full:3"]
    assert result.best.fits
    # one mode only: the table keeps its old columns
    assert "recompute" not in explore(TINY, DGX_A100_80GB, 1, 2, (2,)).table()


def test_auto_is_at_least_as_fast_as_any_single_mode_for_gpt3():
    auto = explore(GPT3_175B, DGX_A100_80GB, 1024, 1536, recompute="auto")
    for mode in ("none", "selective", "full"):
        single = explore(GPT3_175B, DGX_A100_80GB, 1024, 1536, recompute=mode)
        if single.fitting():
            assert auto.best.prediction.total_s <= single.best.prediction.total_s
    assert auto.best.fits
    assert len({c.record()["recompute"] for c in auto.candidates}) > 1
    assert "recompute" in auto.table(top=3).splitlines()[2]       # after a 2-line title


def test_explore_refuses_an_unknown_recompute_naming_the_choices():
    with pytest.raises(ValueError, match=r"recompute must be one of \('none', 'selective', "
                                         r"'full', 'auto'\), got 'some'"):
        explore(TINY, DGX_A100_80GB, 1, 2, recompute="some")


def test_the_explorer_takes_megatron_fsdp_strategies_and_zero3_fits_where_no_shard_does_not():
    """GPT-3 175B on 64 A100s: ZeRO-3 divides the weights and gradients by d too, so more splits
    fit than without sharding (the 16 bytes per parameter split as the cost model's tests
    work by hand), and the assumptions say which strategy was ranked."""
    kw = dict(model=GPT3_175B, cluster=DGX_A100_80GB, num_gpus=64, global_batch_size=64,
              micro_batch_sizes=(1,), recompute="full")
    plain = explore(**kw, data_parallel_sharding_strategy="no_shard")
    zero3 = explore(**kw, data_parallel_sharding_strategy="optim_grads_params")
    assert len(zero3.fitting()) > len(plain.fitting())
    assert "data-parallel sharding (Megatron-FSDP's names): optim_grads_params" in \
        zero3.assumptions()
    with pytest.raises(ValueError):
        explore(**kw, data_parallel_sharding_strategy="zero3")
