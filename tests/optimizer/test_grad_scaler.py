"""The fp16 loss scaler against Megatron-core's ``DynamicGradScaler.update``, worked by hand
step by step (megatron/core/optimizer/grad_scaler.py: an overflow resets the growth count and
spends one unit of hysteresis, the scale backs off once the hysteresis is spent; a growth
restores the hysteresis), and train_gpt.py's flags for it (Megatron-LM's names and defaults,
but the initial scale)."""
import pytest

from mpu_lab.core.optimizer import DynamicGradScaler
from mpu_lab.training import arguments
from mpu_lab.training.setup import build_grad_scaler

INF, OK = True, False


def scales(scaler, steps):
    out = []
    for found_inf in steps:
        scaler.update(found_inf)
        out.append(scaler.scale)
    return out


def megatron_lm(initial_scale=2.0 ** 16, min_scale=1.0, growth_interval=1000, hysteresis=2):
    """As Megatron-LM's get_megatron_optimizer builds it: growth 2, backoff 0.5."""
    return DynamicGradScaler(initial_scale, min_scale, 2.0, 0.5, growth_interval, hysteresis)


def test_with_hysteresis_2_the_first_overflow_skips_only_and_each_later_one_halves():
    assert scales(megatron_lm(), [INF, INF, INF]) == [2.0 ** 16, 2.0 ** 15, 2.0 ** 14]


def test_clean_steps_short_of_a_growth_do_not_restore_the_hysteresis():
    # one unit spent at step 1; five clean steps (window 1000) give nothing back
    assert scales(megatron_lm(), [INF, OK, OK, OK, OK, OK, INF]) == [2.0 ** 16] * 6 + [2.0 ** 15]


def test_a_growth_doubles_the_scale_and_restores_the_hysteresis():
    scaler = megatron_lm(growth_interval=2)
    assert scales(scaler, [INF, OK, OK]) == [2.0 ** 16, 2.0 ** 16, 2.0 ** 17]
    assert scales(scaler, [INF, INF]) == [2.0 ** 17, 2.0 ** 16]
    # an overflow also restarts the count of clean steps towards the next growth
    assert scales(scaler, [OK, INF, OK, OK]) == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 16]


def test_with_hysteresis_1_every_overflow_halves_down_to_the_floor():
    assert scales(megatron_lm(initial_scale=4.0, min_scale=1.0, hysteresis=1),
                  [INF, INF, INF]) == [2.0, 1.0, 1.0]


def test_state_dict_round_trip_keeps_scale_and_both_counts():
    scaler = megatron_lm(growth_interval=3)
    scales(scaler, [INF, OK])
    assert scaler.state_dict() == {"scale": 2.0 ** 16, "growth_tracker": 1,
                                   "hysteresis_tracker": 1}
    copy = megatron_lm(initial_scale=8.0, growth_interval=3)
    copy.load_state_dict(scaler.state_dict())
    assert scales(copy, [OK, OK, INF]) == scales(scaler, [OK, OK, INF]) == [
        2.0 ** 16, 2.0 ** 17, 2.0 ** 17]


def test_train_gpt_builds_megatron_lms_scaler_from_its_flags():
    args = arguments.parse_args(["--fp16"])
    assert (args.min_loss_scale, args.loss_scale_window, args.hysteresis) == (1.0, 1000, 2)
    scaler = build_grad_scaler(args)
    assert (scaler.scale, scaler.min_scale, scaler.growth_factor, scaler.backoff_factor,
            scaler.growth_interval, scaler.hysteresis) == (2.0 ** 16, 1.0, 2.0, 0.5, 1000, 2)
    scaler = build_grad_scaler(arguments.parse_args(["--fp16", "--hysteresis", "1",
                                                     "--loss-scale-window", "10"]))
    assert (scaler.hysteresis, scaler.growth_interval) == (1, 10)


@pytest.mark.parametrize("flags, named", [
    (["--hysteresis", "0"], "--hysteresis (0)"),
    (["--loss-scale-window", "0"], "--loss-scale-window (0)"),
    (["--min-loss-scale", "0"], "--min-loss-scale (0.0)"),
    (["--min-loss-scale", "4", "--initial-loss-scale", "2"], "--min-loss-scale (4.0)"),
])
def test_a_bad_loss_scale_flag_is_refused_naming_it(flags, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        arguments.validate_args(arguments.parse_args(["--fp16", *flags]), world_size=1)
