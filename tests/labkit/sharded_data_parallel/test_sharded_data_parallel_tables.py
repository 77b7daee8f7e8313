"""Lab 05's predictions and tables against values worked by hand (fp32 Adam: 4 + 4 + 8 bytes
per parameter; ZeRO's stages divide, in turn, the states, the gradients, the weights by d;
ring bytes 2(d-1)/d and 3(d-1)/d of Ψ), and the peak model on unit sizes counted by hand."""
import types

import pytest

from mpu_lab.labkit.sharded_data_parallel import exercises, lessons, viz


def test_bytes_per_parameter_are_zero_s_stages_worked_by_hand():
    # d = 4: 4+4+8 = 16; 4+4+8/4 = 10; 4+4/4+2 = 7; 1+1+2 = 4
    assert exercises.bytes_per_parameter(4) == {"no_shard": 16, "optim": 10, "optim_grads": 7,
                                                "optim_grads_params": 4}
    assert exercises.bytes_per_parameter(8)["optim_grads_params"] == 2


def test_the_checks_accept_the_right_answers_and_name_the_wrong_entries(capsys):
    right = {"no_shard": 16, "optim": 10, "optim_grads": 7, "optim_grads_params": 4}
    assert exercises.check_bytes_per_parameter(right, d=4)
    assert not exercises.check_bytes_per_parameter(dict(right, optim_grads=10), d=4)
    out = capsys.readouterr().out
    assert "Not yet: optim_grads not yet." in out
    assert not exercises.check_bytes_per_parameter(None)
    assert "No answer yet" in capsys.readouterr().out
    assert not exercises.check_bytes_per_parameter({"no_shard": 16})
    assert "give a dict with the keys" in capsys.readouterr().out
    # 2 * 3/4 = 1.5 and 3 * 3/4 = 2.25
    assert exercises.check_bytes_per_step({"no_shard": 1.5, "optim_grads_params": 2.25}, d=4)
    assert "1.5 x" in capsys.readouterr().out
    assert not exercises.check_bytes_per_step({"no_shard": 2, "optim_grads_params": 3}, d=4)


def test_unit_sizes_are_counted_by_hand():
    # h = 30: a layer 12*900 + 13*30 = 11,190; root (256 + 32) * 30 + 2 * 30 = 8,700
    assert lessons.unit_numels(2, 30, 32, 256) == [8700, 11190, 11190]
    assert lessons.padded(11190, 4) == 11192 and lessons.padded(8700, 4) == 8700


def test_the_peak_model_puts_optim_grads_above_optim_only_for_large_units():
    # units [root 8, 4, 4, 4, 4] at d = 4 (no padding): Ψ = 24, shard 6.
    small = [8, 4, 4, 4, 4]
    peak = lessons.transient_bytes("optim_grads", small, 4)
    assert peak == dict(weights=4 * 24, gradients=4 * (6 + 8 + 4 + 4))      # 22 < 24
    assert lessons.transient_bytes("optim", small, 4) == dict(weights=96, gradients=96)
    assert lessons.transient_bytes("optim_grads_params", small, 4)["weights"] == 4 * 22
    one = [8, 16]                                    # one unit for the stack: 6 + 8 + 16 = 30 > 24
    assert lessons.transient_bytes("optim_grads", one, 4)["gradients"] == 4 * 30


def test_step_bytes_follow_the_ring(capsys):
    # d = 4, Ψ = 100 elements = 400 bytes: all-reduce 2*3/4*400 = 600; ZeRO-3: two all-gathers
    # of a 100-byte shard (3 * 100 each) and a reduce-scatter of 400 (3/4 * 400) = 900
    counted = {"no_shard": dict(calls=[["all-reduce", 400]], psi=100, d=4),
               "optim_grads_params": dict(calls=[["all-gather", 100], ["all-gather", 100],
                                                 ["reduce-scatter", 400]], psi=100, d=4)}
    assert lessons.step_bytes(counted["no_shard"]) == {"all-reduce": 600}
    assert sum(lessons.step_bytes(counted["optim_grads_params"]).values()) == pytest.approx(900)
    lessons.print_step_bytes(counted)
    out = capsys.readouterr().out
    assert "counted = formula for every strategy (relative 1e-06): yes" in out
    assert "optim_grads_params / no_shard: 1.50 x" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_the_picture_stacks_counted_and_formula_bars_per_strategy():
    counted = {s: types.SimpleNamespace(results=[{"metrics": [dict(
        param_bytes=400, grad_bytes=400, optimizer_state_bytes=800)]}]) for s in lessons.STRATEGIES}
    fig = viz.plot_resident(counted, [100], 4)
    bars = fig.axes[0].patches
    assert len(bars) == 4 * 2 * 3                      # strategies x (counted, formula) x terms
    # the formula's ZeRO-3 bars: 100 elements * (4 + 4 + 8) bytes / 4 = 400 bytes, stacked
    tops = [b.get_y() + b.get_height() for b in bars[-3:]]
    assert tops == pytest.approx([100 / 1024, 200 / 1024, 400 / 1024])
