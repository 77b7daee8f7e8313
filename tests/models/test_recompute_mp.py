"""Activation recomputation at TP = 2 with dropout on (tests/mp/recompute_checks.py, in the
shared 4-rank job): every mode equals no recomputation, with sequence parallelism, with
Megatron's distributed saved activations (which keep half of each layer input per rank), and
in training at TP = 2 x PP = 2 through train_gpt.py's flags."""
import pytest


@pytest.fixture(scope="module")
def reports(four_rank_job):
    return [rep["recompute"] for rep in four_rank_job[0]]


def test_every_mode_equals_no_recomputation_at_tp2_with_sequence_parallelism(reports):
    for r in reports:
        assert set(r["sp_loss_diff"]) == {"selective", "selective_mlp", "full_uniform_2",
                                          "full_block_1"}
        assert max(r["sp_loss_diff"].values()) <= 1e-6
        assert max(r["sp_grad_diff"].values()) <= 1e-6
        assert r["other_masks_grad_diff"] > 1e-4          # the masks are in the comparison


def test_distributed_saved_activations_equal_and_keep_half_of_each_layer_input(reports):
    for r in reports:
        assert r["distributed_loss_diff"] <= 1e-6
        assert r["distributed_grad_diff"] <= 1e-6 and r["full_grad_diff"] <= 1e-6
        # the same tensors saved; three layer inputs [16, 2, 32] kept at half their size
        assert r["saved_tensors"]["full"] == r["saved_tensors"]["distributed"]
        assert r["saved_numel_difference"] == 3 * r["layer_input_numel"] // 2


def test_training_at_tp2_pp2_with_dropout_equals_no_recomputation_in_every_mode(reports):
    for r in reports:
        loop = r["loop"]
        assert [loop[m]["granularity"] for m in loop] == [None, "selective", "full", "full"]
        ref = loop["none"]
        assert len(ref["lm_loss"]) == 2
        for mode, run in loop.items():
            for key in ("lm_loss", "grad_norm"):
                for got, want in zip(run[key], ref[key]):
                    assert abs(got - want) <= 1e-6 * abs(want), (mode, key, run[key], ref[key])
