"""The fp16 loss scaler's state in a checkpoint: Megatron saves the ``DynamicGradScaler``'s
scale, growth count and unspent hysteresis with the optimizer, so a resumed run backs off when
the uninterrupted one would. One process (the module's one-rank gloo world), a tiny GPT, an
overflow forced through the fp16-overflow fault's callback.

References: the scaler's states worked by hand from Megatron's update rule (hysteresis 2,
window 1000: an overflow resets the growth count and spends one unit of hysteresis; the scale
halves when none is left), and the uninterrupted run's loss scales."""
from mpu_lab import training
from mpu_lab.training import checkpointing, faults
from tiny_gpt import tiny_state

FRESH = {"scale": 2.0 ** 16, "growth_tracker": 0, "hysteresis_tracker": 2}


def overflow_at(*iterations):
    """Callbacks that make the (one) rank's gradients overflow in each of ``iterations``."""
    return [c for it in iterations for c in faults.inject(faults.Fault("fp16-overflow", 0, it))]


def test_a_resumed_fp16_run_keeps_the_scalers_state_and_backs_off_as_the_uninterrupted_one(
        world, tmp_path):
    whole = training.train(tiny_state("--fp16", "--train-iters", 4), log=lambda s: None,
                           callbacks=overflow_at(2, 4))
    # iteration 2 spends one unit of hysteresis, iteration 4 the last: the scale halves there
    assert [m["loss_scale"] for m in whole] == [2.0 ** 16] * 3 + [2.0 ** 15]

    first = tiny_state("--fp16", "--train-iters", 3, "--save", tmp_path)
    training.train(first, log=lambda s: None, callbacks=overflow_at(2))
    # 1: growth 1; 2: overflow, growth 0, hysteresis 2 -> 1; 3: growth 1
    saved = {"scale": 2.0 ** 16, "growth_tracker": 1, "hysteresis_tracker": 1}
    assert first.scaler.state_dict() == saved

    resumed = tiny_state("--fp16", "--train-iters", 4, "--load", tmp_path)
    assert resumed.iteration == 3 and resumed.scaler.state_dict() == saved
    last = training.train(resumed, log=lambda s: None, callbacks=overflow_at(4))
    assert [m["loss_scale"] for m in last] == [whole[-1]["loss_scale"]]

    # --no-load-optim leaves the optimizer's state, the scaler's with it, fresh (Megatron's)
    assert tiny_state("--fp16", "--load", tmp_path, "--no-load-optim").scaler.state_dict() == FRESH


def test_a_checkpoint_saved_without_fp16_leaves_the_scaler_fresh(world, tmp_path):
    training.train(tiny_state("--train-iters", 1, "--save", tmp_path), log=lambda s: None)
    state = tiny_state("--fp16", "--train-iters", 2)
    info = checkpointing.load_checkpoint(tmp_path, state.model, grad_scaler=state.scaler)
    assert info["grad_scaler"] is False and state.scaler.state_dict() == FRESH
