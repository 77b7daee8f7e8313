"""The split backward of the linear layers (Qi et al. 2024 §2; Megatron-core's
``delay_wgrad_compute``) against the unsplit backward of the same layer, in a world of one rank:
under ``delay_wgrad_compute(store)`` backward gives the same input and bias gradients, leaves the
weight's alone and puts its GEMM in the store; running the store then gives the weight gradient,
bit for bit, micro-batch after micro-batch."""
import pytest
import torch
import torch.distributed as dist

from mpu_lab.core import parallel_state as ps
from mpu_lab.core import tensor_parallel as tp
from mpu_lab.core.tensor_parallel.linear_autograd import delay_wgrad_compute


@pytest.fixture(scope="module")
def world_of_one():
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        created = True
    elif dist.get_world_size() != 1:
        pytest.skip("a multi-rank process group is already running in this process")
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


def twins(cls, **kwargs):
    """Two layers with the same weights (the same seed) and a non-zero bias."""
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        layers.append(cls(16, 24, **kwargs))
    with torch.no_grad():
        if layers[0].bias is not None:
            layers[0].bias.normal_()
            layers[1].bias.copy_(layers[0].bias)
    return layers


def microbatches(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 24, generator=g))
            for _ in range(n)]


def run(layer, x, dy, store=None):
    """Forward and backward of one micro-batch; with ``store``, the backward's B only."""
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    delay_wgrad_compute(store)
    try:
        out.backward(dy)
    finally:
        delay_wgrad_compute(None)
    return x.grad


@pytest.mark.parametrize("cls", [tp.ColumnParallelLinear, tp.RowParallelLinear])
def test_b_gives_the_input_gradient_and_w_the_weight_gradient_of_the_unsplit_backward(
        world_of_one, cls):
    unsplit, split = twins(cls)
    stores = []
    for x, dy in microbatches():                        # B of every micro-batch first
        stores.append([])
        assert torch.equal(run(split, x, dy, stores[-1]), run(unsplit, x, dy))
        assert len(stores[-1]) == 1                     # one GEMM: this layer's dW
    assert split.weight.grad is None                    # nothing of W has run
    assert torch.equal(split.bias.grad, unsplit.bias.grad)
    for store in stores:                                # then the W's, oldest first
        for gemm in store:
            gemm()
    assert torch.equal(split.weight.grad, unsplit.weight.grad)


def test_one_w_after_each_b_gives_the_same_sum(world_of_one):
    """W right after its B, as the steady state of ZB-H1 runs them."""
    unsplit, split = twins(tp.ColumnParallelLinear)
    for x, dy in microbatches():
        run(unsplit, x, dy)
        store = []
        run(split, x, dy, store)
        store[0]()
    assert torch.equal(split.weight.grad, unsplit.weight.grad)


def test_deferred_weight_gradient_goes_to_main_grad_with_gradient_accumulation_fusion(world_of_one):
    unsplit, split = twins(tp.RowParallelLinear, gradient_accumulation_fusion=True)
    for layer in (unsplit, split):
        layer.weight.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)
    store = []
    for x, dy in microbatches(2):
        run(unsplit, x, dy)
        run(split, x, dy, store)
    assert not split.weight.main_grad.any()             # still waiting
    for gemm in store:
        gemm()
    assert torch.equal(split.weight.main_grad, unsplit.weight.main_grad)
    assert split.weight.grad is None and unsplit.weight.grad is None


def test_without_a_store_backward_is_unchanged(world_of_one):
    """No store (the default): the weight gradient comes with backward and equals torch's own
    F.linear autograd (an independent reference)."""
    torch.manual_seed(0)
    layer = tp.ColumnParallelLinear(16, 24, bias=False)
    x, dy = microbatches(1)[0]
    run(layer, x, dy)
    w = layer.weight.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(x, w).backward(dy)
    torch.testing.assert_close(layer.weight.grad, w.grad, rtol=1e-6, atol=1e-6)
