"""Activation recomputation (Megatron-core's ``recompute_*`` fields) at TP = 1 in one process:
every mode gives the gradients of no recomputation with dropout on, because the checkpoint
replays the RNG states, the tracker's included; ``torch.utils.checkpoint``, which replays the
default generator only, does not (the attention dropout draws from the tracker). The
multi-rank cases (TP = 2 with sequence parallelism, PP = 2) run in tests/mp/recompute_checks.py.
"""
import pytest
import torch
import torch.utils.checkpoint

from mpu_lab.core.models.gpt import GPTModel
from mpu_lab.core.tensor_parallel import checkpoint, model_parallel_manual_seed
from mpu_lab.core.transformer import TransformerConfig

pytestmark = pytest.mark.usefixtures("world")   # a one-rank world (tests/conftest.py)

MODES = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "selective_mlp": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
    "full_uniform_1": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
    "full_uniform_2": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=2),
    "full_uniform_3": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=3),   # groups of 3 and 1 over 4 layers
    "full_block_1": dict(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=1),
}


def config(**recompute):
    return TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4,
                             hidden_dropout=0.1, attention_dropout=0.1,
                             attention_impl="explicit", **recompute)


def loss_and_grads(cfg, layer_wrapper=None):
    """One training step's loss and every gradient, from the same seed and data."""
    model_parallel_manual_seed(1234)
    model = GPTModel(cfg, 128, 16)
    if layer_wrapper is not None:
        for layer in model.decoder.layers:
            layer.forward = layer_wrapper(layer.forward)     # the model's own object, a test foil
    model.train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    labels = torch.randint(0, 128, (2, 16), generator=g)
    model_parallel_manual_seed(99)                            # the dropout streams
    loss = model(ids, labels=labels).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads(config())


@pytest.mark.parametrize("mode", [m for m in MODES if m != "none"])
def test_every_recompute_mode_gives_the_gradients_of_no_recomputation_with_dropout_on(
        reference, mode):
    loss, grads = loss_and_grads(config(**MODES[mode]))
    ref_loss, ref_grads = reference
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    for name, grad in ref_grads.items():
        assert torch.allclose(grads[name], grad, rtol=0, atol=1e-6), name


def test_dropout_is_on_so_the_check_above_can_fail(reference):
    """Another dropout seed gives another loss: the masks matter to the comparison."""
    model_parallel_manual_seed(1234)
    model = GPTModel(config(), 128, 16).train()
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)
    model_parallel_manual_seed(100)
    assert abs(model(ids, labels=labels).mean().item() - reference[0]) > 1e-4


def test_a_checkpoint_that_forgets_the_tracker_gives_other_gradients(reference):
    """torch.utils.checkpoint restores the default generator only: the attention dropout,
    drawn from the tracker's stream in the recomputation, gets another mask."""
    def wrap(forward):
        return lambda x: torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False)
    _, grads = loss_and_grads(config(), layer_wrapper=wrap)
    worst = max((grads[n] - g).abs().max().item() for n, g in reference[1].items())
    assert worst > 1e-4


def test_the_checkpoint_replays_the_tracker_for_one_function():
    """``checkpoint`` itself: dropout drawn from the tracker inside gives the same gradient
    as the plain call (the mask replayed), with the tracker left where the plain call left it."""
    from mpu_lab.core.tensor_parallel import get_rng_tracker

    def f(x):
        with get_rng_tracker().fork():
            return torch.nn.functional.dropout(x, p=0.5) * 3

    grads, after = [], []
    for use_checkpoint in (False, True):
        model_parallel_manual_seed(7)
        x = torch.ones(64, requires_grad=True)
        y = checkpoint(f, False, x) if use_checkpoint else f(x)
        y.sum().backward()
        grads.append(x.grad)
        with get_rng_tracker().fork():
            after.append(torch.rand(3))
    assert torch.equal(grads[0], grads[1]) and grads[0].count_nonzero() not in (0, 64)
    assert torch.equal(after[0], after[1])


@pytest.mark.parametrize("fields,message", [
    (dict(recompute_granularity="partial"), r"None, 'full' or 'selective', got 'partial'"),
    (dict(recompute_granularity="full"), r"needs recompute_method 'uniform'"),
    (dict(recompute_granularity="full", recompute_method="uniform"),
     r"needs recompute_num_layers between 1"),
    (dict(recompute_granularity="selective", recompute_num_layers=2),
     r"recompute_num_layers must be None, got 2"),
    (dict(recompute_granularity="full", recompute_method="stripes", recompute_num_layers=1),
     r"'uniform' or 'block', got 'stripes'"),
    (dict(recompute_granularity="selective", recompute_modules=["attention"]),
     r"\['attention'\] are not Megatron's"),
    (dict(recompute_granularity="selective", recompute_modules=["moe_act"]),
     r"\['moe_act'\] are Megatron-core's but not built here"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1,
          distribute_saved_activations=True, sequence_parallel=True),
     r"must be False with sequence_parallel"),
])
def test_recompute_fields_are_refused_as_megatron_core_refuses_them(fields, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, **fields)


def test_distributed_saved_activations_are_refused_by_the_flags_not_the_config():
    # Megatron-core's TransformerConfig takes distribute_saved_activations with selective
    # recomputation (nothing uses it there); Megatron-LM's validate_args refuses the flags
    TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                      recompute_granularity="selective", distribute_saved_activations=True)
    from mpu_lab.training.arguments import parse_args, validate_args
    from mpu_lab.training.flag_errors import FlagError
    flags = ["--tensor-model-parallel-size", "2", "--distribute-saved-activations"]
    with pytest.raises(FlagError, match="it needs --recompute-granularity full, got selective"):
        validate_args(parse_args(flags + ["--recompute-activations"]), 2)
    with pytest.raises(FlagError, match="it needs --recompute-granularity full, got None"):
        validate_args(parse_args(flags), 2)
    validate_args(parse_args(flags + ["--recompute-granularity", "full", "--recompute-method",
                                      "uniform", "--recompute-num-layers", "1"]), 2)


def test_recompute_modules_default_to_the_attention_core():
    assert TransformerConfig(2, 16, 4).recompute_modules == ["core_attn"]
