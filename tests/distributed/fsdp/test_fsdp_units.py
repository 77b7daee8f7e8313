"""Megatron-FSDP's flat units (mpu_lab.core.distributed.fsdp), one process: a unit's buffer
layout, padding and shards worked by hand; the units a module tree gives; ZeRO-3's hooks on a
one-rank world against the same model unwrapped (gradients, parameters freed, the all-gathers
CommDebugMode sees: two per unit per step, the next unit's issued before this one computes),
on a toy and on the GPT at both unit sizes; the cost model's formulas by hand. The strategies
on real worlds are in test_megatron_fsdp_mp.py."""
import pytest
import torch

from mpu_lab import training
from mpu_lab.core.distributed import fsdp
from mpu_lab.core.distributed.fsdp import (FullyShardedDataParallel, MegatronFSDP, ParameterGroup,
                                           fsdp_units)
from mpu_lab.core.transformer import TransformerBlock
from mpu_lab.perf import cost_model
from mpu_lab.perf.comm_counts import CollectiveLog
from mpu_lab.training.setup import get_model


def _params(*sizes):
    return [torch.nn.Parameter(torch.arange(n, dtype=torch.float32) + 100 * i)
            for i, n in enumerate(sizes)]


def test_a_unit_lays_its_parameters_end_to_end_padded_to_a_multiple_of_d():
    a, b, c = _params(3, 5, 2)              # 10 elements -> 12 for d = 4, shards of 3
    group = ParameterGroup([a, b, c], fsdp_unit_id=1, data_parallel_size=4,
                           data_parallel_rank=1, shard_params=False)
    assert (group.numel_unpadded, group.numel, group.shard_numel) == (10, 12, 3)
    assert [group.param_range(p) for p in (a, b, c)] == [(0, 3), (3, 8), (8, 10)]
    # rank 1 owns [3, 6): nothing of a, b's first three elements, nothing of c
    assert [group.shard_range(p) for p in (a, b, c)] == [None, (0, 3), None]
    assert group.main_weight.tolist() == [100.0, 101.0, 102.0]
    # optim_grads: the parameters are views of the whole buffer, the shard too
    group.model_weight[3] = -1.0
    assert b[0].item() == -1.0 and group.main_weight[0].item() == -1.0
    assert group.main_grad.shape == (3,)


def test_zero3_keeps_only_the_shard_and_frees_the_parameters():
    a, b = _params(3, 4)                    # 7 elements -> 8 for d = 2
    group = ParameterGroup([a, b], 0, data_parallel_size=2, data_parallel_rank=1,
                           shard_params=True)
    assert group.main_weight.tolist() == [101.0, 102.0, 103.0, 0.0]   # b[1:], then padding
    assert a.numel() == b.numel() == 0 and not group.is_unsharded
    group.install(torch.arange(8, dtype=torch.float32))
    assert a.shape == (3,) and b.tolist() == [3.0, 4.0, 5.0, 6.0] and group.is_unsharded


def test_flat_grad_is_zero_padded_and_drops_the_grads():
    a, b = _params(3, 2)
    group = ParameterGroup([a, b], 0, data_parallel_size=4, data_parallel_rank=0,
                           shard_params=False)
    a.grad = torch.ones(3)
    flat = group.flat_grad()                 # b has no gradient: zeros
    assert flat.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0] and a.grad is None


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(3, 3)


def test_units_are_the_outermost_modules_of_the_unit_classes():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), _Block(), torch.nn.Sequential(_Block()))
    units = fsdp_units(model, [_Block, torch.nn.Linear])
    assert units == [model[0], model[1], model[2][0]]       # not _Block's inner Linear


def test_the_cost_model_names_the_mirror_s_strategies():
    assert cost_model.DATA_PARALLEL_SHARDING_STRATEGIES == fsdp.DATA_PARALLEL_SHARDING_STRATEGIES


def test_megatron_fsdp_leaves_no_shard_and_optim_to_data_parallelism():
    with pytest.raises(ValueError, match=r"optim are DistributedDataParallel"):
        MegatronFSDP(torch.nn.Linear(2, 2), data_parallel_sharding_strategy="optim")


class _Toy(torch.nn.Module):
    """Three Linear units and a root LayerNorm that runs first and last."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(6)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(3))

    def forward(self, x):
        x = self.norm(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x)


def test_zero3_hooks_gather_twice_free_after_and_keep_the_gradients(world):
    reference, model = _Toy(), _Toy()
    wrapped = MegatronFSDP(model, data_parallel_sharding_strategy="optim_grads_params",
                           fsdp_unit_modules=[torch.nn.Linear])
    assert all(p.numel() == 0 for p in model.parameters())        # sharded at rest
    x = torch.randn(4, 6)
    with CollectiveLog() as log:
        wrapped(x).square().sum().backward()
        wrapped.finish_grad_sync()
    reference(x).square().sum().backward()
    gathers = [e for e in log.events if e["kind"] == "all_gather"]
    assert len(gathers) == 2 * 4                                    # 3 units + the root
    assert all(p.numel() == 0 for p in model.parameters())        # freed after backward
    got = {id(p): (shard, a, b) for p, shard, a, b in wrapped.optimizer_shards()}
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        shard, a, b = got[id(p)]
        torch.testing.assert_close(shard.grad, q.grad.reshape(-1)[a:b], msg=name)
        torch.testing.assert_close(shard, q.detach().reshape(-1)[a:b], msg=name)


def test_bytes_per_parameter_learns_the_four_strategies():
    bpp = cost_model.bytes_per_parameter
    for params, grads in (("fp16", "fp16"), ("bf16", "fp32"), ("fp32", "fp32")):
        assert bpp(params, grads, data_parallel_size=4,
                   data_parallel_sharding_strategy="no_shard") == bpp(params, grads)
        assert bpp(params, grads, data_parallel_size=4, data_parallel_sharding_strategy="optim") \
            == bpp(params, grads, distributed_optimizer=True, data_parallel_size=4)
    # bf16 params, fp32 main grads (Megatron's table: 2 + 4 + 12): by hand at d = 4
    assert bpp("bf16", "fp32", data_parallel_size=4,
               data_parallel_sharding_strategy="optim_grads") == 2 + 4 / 4 + 12 / 4
    assert bpp("bf16", "fp32", data_parallel_size=4,
               data_parallel_sharding_strategy="optim_grads_params") == 18 / 4
    assert bpp("fp32", "fp32", data_parallel_size=8,
               data_parallel_sharding_strategy="optim_grads_params") == 2.0
    with pytest.raises(ValueError, match="not both"):
        bpp("fp32", "fp32", True, 4, data_parallel_sharding_strategy="optim")
    with pytest.raises(ValueError, match="one of no_shard, optim, optim_grads"):
        bpp("fp32", "fp32", data_parallel_sharding_strategy="zero3")


def test_ring_bytes_and_bytes_per_step_by_hand():
    assert cost_model.ring_bytes("all_reduce", 400, 4) == 600        # 2 x 3/4
    assert cost_model.ring_bytes("reduce_scatter", 400, 4) == 300    # 3/4 of the whole
    assert cost_model.ring_bytes("all_gather", 100, 4) == 300        # 3 other ranks' shards
    assert cost_model.data_parallel_bytes_per_step("no_shard", 400, 4) == 600
    assert cost_model.data_parallel_bytes_per_step("optim_grads_params", 400, 4) == 900
    assert cost_model.resident_bytes_per_rank("optim_grads", 1000, 4) == dict(
        param_bytes=4000, grad_bytes=1000, optimizer_state_bytes=2000)


def test_zero3_prefetches_the_next_unit_and_frees_each_after_its_forward(world):
    """Seen from hooks registered after the wrapper's: when layer k's forward ends, the
    all-gathers of the root, of layer k and of layer k + 1 (the prefetch, issued before layer
    k computed) have been issued — k + 3 of them — and layer k's parameters are freed again.
    Without the prefetch the counts would be k + 2."""
    model = _Toy()
    MegatronFSDP(model, data_parallel_sharding_strategy="optim_grads_params",
                 fsdp_unit_modules=[torch.nn.Linear])
    seen = []
    with CollectiveLog() as log:
        def after_forward(module, args, output):
            gathers = sum(e["kind"] == "all_gather" for e in log.events)
            seen.append((gathers, sum(p.numel() for p in module.parameters())))
        for layer in model.layers:
            layer.register_forward_hook(after_forward)
        with torch.no_grad():
            model(torch.randn(2, 6))
    assert seen == [(3, 0), (4, 0), (4, 0)]
    assert all(p.numel() == 0 for p in model.parameters())      # the root freed at the end


@pytest.mark.parametrize("units, sizes", [
    (None, [4672, 12704, 12704]),      # root (embeddings, final LayerNorm), one per layer
    ((TransformerBlock,), [4608, 25472]),   # root (embeddings), the whole decoder
])
def test_the_unit_size_knob_on_the_gpt_keeps_its_gradients(world, units, sizes):
    """Megatron-core's units (FullyShardedDataParallel): one per TransformerLayer by default,
    one for the TransformerBlock on request; ZeRO-3 on one rank against the unwrapped twin."""
    args = training.validate_args(training.parse_args([str(a) for a in [
        "--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 16,
        "--vocab-size", 128, "--make-vocab-size-divisible-by", 32, "--micro-batch-size", 2,
        "--global-batch-size", 2]]), 1)
    torch.manual_seed(0)
    reference = get_model(args)
    torch.manual_seed(0)
    model = get_model(args)
    wrapped = FullyShardedDataParallel(model, None, "optim_grads_params", fsdp_unit_modules=units)
    assert [g.numel for g in wrapped.parameter_groups] == sizes
    tokens, labels = torch.randint(0, 128, (2, 2, 16))
    reference(tokens, labels=labels).mean().backward()
    with CollectiveLog() as log:
        model(tokens, labels=labels).mean().backward()
        wrapped.finish_grad_sync()
    assert sum(e["kind"] == "all_gather" for e in log.events) == 2 * len(sizes)
    got = {id(p): (shard, a, b) for p, shard, a, b in wrapped.optimizer_shards()}
    for p, q in zip(model.parameters(), reference.parameters()):
        shard, a, b = got[id(p)]
        torch.testing.assert_close(shard.grad, q.grad.reshape(-1)[a:b], rtol=0, atol=0)
