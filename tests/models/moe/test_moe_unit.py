"""mpu_lab.core.transformer.moe in one process: the routing maths, the capacity, the load-balancing loss
and the permutations on values worked by hand; the aux-loss autograd Function against autograd
of the summed loss; TransformerConfig.check_moe's refusals; and the whole MoELayer at ep = 1
(a one-rank world) against the plain MoE of tests/mp/moe_reference.py.
"""
import math
import pathlib
import sys

import pytest
import torch

from mpu_lab.core.comm import exchange
from mpu_lab.core.transformer import TransformerConfig
from mpu_lab.core.transformer.moe import (
    MoEAuxLossAutoScaler, MoELayer, apply_router_token_dropping, get_capacity, permute,
    sort_chunks_by_idxs, switch_load_balancing_loss_func, topk_routing_with_score_function,
    unpermute)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "mp"))
import moe_reference  # noqa: E402  (the plain MoE, shared with the multi-rank worker)


# --------------------------------------------------------------------------- routing by hand
def test_softmax_top2_probs_are_a_softmax_over_the_two_chosen_logits():
    probs, routing_map = topk_routing_with_score_function(torch.tensor([[1.0, 3.0, 2.0]]), 2)
    e = math.e
    assert routing_map.tolist() == [[False, True, True]]
    assert torch.allclose(probs, torch.tensor([[0.0, e / (e + 1), 1 / (e + 1)]]))


def test_pre_softmax_top1_keeps_the_probability_over_all_experts():
    probs, routing_map = topk_routing_with_score_function(
        torch.tensor([[0.0, math.log(3.0)]]), 1, use_pre_softmax=True)
    assert routing_map.tolist() == [[False, True]]
    assert torch.allclose(probs, torch.tensor([[0.0, 0.75]]))


def test_sigmoid_top2_probs_are_the_two_sigmoids_normalised():
    probs, _ = topk_routing_with_score_function(torch.tensor([[0.0, math.log(3.0), -9.0]]), 2,
                                                score_function="sigmoid")
    # sigmoid(0) = 1/2, sigmoid(ln 3) = 3/4: normalised 2/5 and 3/5
    assert torch.allclose(probs, torch.tensor([[0.4, 0.6, 0.0]]))


def test_capacity_is_tokens_times_k_over_experts_times_factor_rounded_up():
    assert get_capacity(8 * 2, 4, 1.25) == 5          # ceil(16 / 4 * 1.25)
    assert get_capacity(6, 4, 1.0) == 2               # ceil(1.5)


def test_token_dropping_keeps_the_highest_probability_tokens_of_a_full_expert():
    # 4 tokens, 2 experts, top-1, factor 1: capacity ceil(4 / 2) = 2; all go to expert 0
    probs = torch.tensor([[0.6, 0.0], [0.9, 0.0], [0.7, 0.0], [0.8, 0.0]])
    kept_probs, kept = apply_router_token_dropping(probs, probs > 0, 1, 1.0)
    assert kept[:, 0].tolist() == [False, True, False, True]
    assert kept_probs[:, 0].tolist() == pytest.approx([0.0, 0.9, 0.0, 0.8])


def test_switch_loss_is_the_coefficient_when_uniform_and_e_times_it_when_collapsed():
    coeff, E, T = 0.01, 2, 4
    uniform = switch_load_balancing_loss_func(torch.full((T, E), 0.5), torch.tensor([2.0, 2.0]),
                                              T, 1, E, coeff)
    collapsed = switch_load_balancing_loss_func(torch.tensor([[1.0, 0.0]] * T),
                                                torch.tensor([4.0, 0.0]), T, 1, E, coeff)
    assert uniform.item() == pytest.approx(coeff)
    assert collapsed.item() == pytest.approx(E * coeff)


def test_aux_loss_scaler_gives_the_gradient_of_the_summed_loss():
    w = torch.randn(3, 4, requires_grad=True)
    x = torch.randn(5, 4)
    act = x @ w.t()
    aux = (act ** 2).mean()
    (MoEAuxLossAutoScaler.apply(act, aux) * 2.0).sum().backward()
    scaled = w.grad.clone()
    w.grad = None
    act = x @ w.t()
    ((act * 2.0).sum() + (act ** 2).mean()).backward()
    assert torch.allclose(scaled, w.grad)


def test_permute_groups_tokens_by_expert_and_unpermute_sums_them_back():
    tokens = torch.tensor([[10.0], [20.0], [30.0]])
    routing_map = torch.tensor([[True, False], [True, True], [False, True]])
    probs = torch.tensor([[0.5, 0.0], [0.25, 0.75], [0.0, 1.0]])
    permuted, permuted_probs, order = permute(tokens, routing_map, probs)
    assert permuted[:, 0].tolist() == [10.0, 20.0, 20.0, 30.0]     # expert 0, then expert 1
    assert permuted_probs.tolist() == [0.5, 0.25, 0.75, 1.0]
    assert unpermute(permuted, order, tokens.shape)[:, 0].tolist() == [10.0, 40.0, 30.0]


def test_sort_chunks_by_idxs_reorders_blocks():
    rows = torch.arange(6.0)
    assert sort_chunks_by_idxs(rows, [1, 2, 3], [2, 0, 1]).tolist() == [3, 4, 5, 0, 1, 2]


# --------------------------------------------------------------------------- config checks
def moe_config(**kw):
    base = dict(num_layers=1, hidden_size=8, num_attention_heads=1, ffn_hidden_size=16,
                num_moe_experts=4)
    return TransformerConfig(**{**base, **kw})


@pytest.mark.parametrize("kw, sizes, words", [
    (dict(moe_router_topk=5), (1, 1, 1), ["moe_router_topk", "1..4", "5"]),
    (dict(), (3, 1, 1), ["num_moe_experts 4", "expert-model-parallel size 3", "[1, 2, 4]"]),
    (dict(), (1, 3, 1), ["ffn_hidden_size 16", "expert-tensor-parallel size 3"]),
    (dict(), (1, 1, 2), ["sequence_parallel", "t = 2"]),
    (dict(moe_router_topk=1), (1, 1, 1), ["moe_router_pre_softmax"]),
    (dict(moe_token_dispatcher_type="flex"), (1, 1, 1), ["alltoall", "'flex'"]),
    (dict(moe_expert_capacity_factor=0.0), (1, 1, 1), ["moe_expert_capacity_factor", "0.0"]),
    (dict(num_moe_experts=None), (1, 1, 1), ["num_moe_experts", "None"]),
])
def test_check_moe_refuses_bad_options_naming_the_numbers(kw, sizes, words):
    with pytest.raises(ValueError) as info:
        moe_config(**kw).check_moe(*sizes)
    for word in words:
        assert word in str(info.value)


def test_check_moe_accepts_a_valid_layout():
    moe_config(sequence_parallel=True).check_moe(4, 2, 2)


# --------------------------------------------------------------------------- the layer, one rank
def test_all_to_all_with_splits_refuses_splits_that_do_not_add_up(world):
    with pytest.raises(ValueError, match=r"add up to 3, not the 4 rows"):
        exchange.all_to_all_with_splits(torch.zeros(4, 2), [3], [3])


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_layer_at_ep1_equals_the_plain_moe_from_the_same_seed(world, dispatcher):
    config = moe_config(init_method_std=0.5, moe_aux_loss_coeff=0.05,
                        moe_token_dispatcher_type=dispatcher)
    router, fc1, fc2 = moe_reference.master_weights(config, seed=7)
    torch.manual_seed(7)
    layer = MoELayer(config)
    assert sorted(name for name, _ in layer.named_parameters()) == sorted(
        ["router.weight"] + [f"experts.local_experts.{i}.linear_fc{j}.weight"
                             for i in range(4) for j in (1, 2)])
    assert torch.equal(layer.router.weight, router)
    assert torch.equal(layer.experts.local_experts[3].linear_fc2.weight, fc2[3])

    x = torch.randn(3, 2, 8)
    leaves = [w.double().requires_grad_(True) for w in [router] + fc1 + fc2]
    x_ref = x.reshape(-1, 8).double().requires_grad_(True)
    outs, _, aux = moe_reference.moe([x_ref], leaves[0], leaves[1:5], leaves[5:], config, [[0]])
    (outs[0].sum() + aux).backward()

    x = x.requires_grad_(True)
    out, bias = layer(x)
    out.sum().backward()
    assert bias is None and out.shape == x.shape
    assert torch.allclose(out.reshape(-1, 8).double(), outs[0], atol=1e-6)
    assert torch.allclose(x.grad.reshape(-1, 8).double(), x_ref.grad, atol=1e-6)
    assert torch.allclose(layer.router.weight.grad.double(), leaves[0].grad, atol=1e-6)
    assert torch.allclose(layer.experts.local_experts[2].linear_fc1.weight.grad.double(),
                          leaves[3].grad, atol=1e-6)
