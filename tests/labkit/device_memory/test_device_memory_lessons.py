"""Lab 03's counts and checks against values worked by hand.

* A GPT of 1 layer, h = 8, s = 4, V = 16 has 12h^2 + 13h + (V + s)h + 2h = 1048 parameters in
  16 tensors; fp32 AdamW keeps 4 + 4 + 8 bytes of each, plus a 4-byte step counter per tensor;
  Megatron's bf16 layout 2 + 4 + (4 + 8) bytes, plus one counter (one flat main tensor).
* Gradient accumulation: the same gradient in 1 or 2 micro-batches, half the activations
  (but for the causal mask, the positions and the loss's scalar, which do not scale with it), the
  same params / grads / optimizer bytes.
* GPT-3 175B per layer at TP = 8 with SP (Korthikanti et al. 2022, Table 2, 2-byte values):
  sbh/t = 2048 * 12288 / 8 = 3,145,728; none x (34 + 5 * 96 * 2048 / 12288 = 114), selective
  x 34, full x 2 bytes.
* Megatron-core's refused ``recompute_*`` combinations, and every printed line <= 100 characters.
"""
import pytest

from mpu_lab.labkit.device_memory import exercises, lessons

TINY = lessons.Shape(layers=1, hidden=8, heads=2, seq_length=4, vocab_size=16)
N, TENSORS = 1048, 16


def test_the_tiny_gpts_fp32_adamw_bytes_are_worked_by_hand(world):
    c = lessons.count_model_state(TINY)
    assert (c["n"], c["tensors"]) == (N, TENSORS)
    assert (c["params"], c["grads"], c["optimizer"]) == (4 * N, 4 * N, 8 * N + 4 * TENSORS)


def test_megatrons_bf16_layout_is_18_bytes_per_parameter_plus_one_counter(world):
    c = lessons.count_bf16_layout(TINY)
    assert (c["params"], c["grads"], c["optimizer"]) == (2 * N, 4 * N, 12 * N + 4)
    text = lessons.format_model_state(lessons.count_model_state(TINY), c)
    assert "18.004" in text and "16.061" in text      # (18N + 4) / N, (16N + 64) / N
    assert max(len(line) for line in text.splitlines()) <= 100


def test_accumulation_keeps_the_gradient_and_halves_the_activations(world):
    rows = lessons.accumulation_rows(TINY, global_batch=4, micro_batches=(1, 2))
    one, two = rows
    assert two["grad_error"] < 1e-6
    assert all(one[k] == two[k] for k in ("params", "grads", "optimizer"))
    assert one["params"] == 4 * N
    # what does not scale with the batch: the causal mask (s^2 = 16 bytes), the positions
    # (8s = 32 bytes) and the loss's 4-byte total weight: 52 bytes, of which half stays
    assert two["activations"] == one["activations"] / 2 + 52 / 2
    text = lessons.format_accumulation(rows)
    assert text.endswith("params, grads, optimizer the same for every split: True\n"
                         "gradient equal to one batch's within 1e-05 (relative): True")
    assert max(len(line) for line in text.splitlines()) <= 100


def test_gpt3_per_layer_is_the_papers_formula_worked_by_hand():
    per = 2048 * 1 * 12288 // 8
    got = exercises.gpt3_activation_mb()
    assert got == pytest.approx({"none": per * 114 * 2 / 2 / 1e6 * 1,
                                 "selective": per * 34 / 1e6, "full": per * 2 / 1e6})
    assert per * 114 == 358_612_992
    text = lessons.format_gpt3()
    assert "none               578.8           358.6                 34.43" in text
    # TP alone: sbh(10 + 24/t + 5as/(ht)) = 25,165,824 * (10 + 3 + 10) bytes = 578.8 MB


def test_the_checks_grade_right_wrong_and_unanswered(capsys):
    assert exercises.check_bytes_per_parameter((16, 18))
    assert not exercises.check_bytes_per_parameter((16, 16))
    assert not exercises.check_bytes_per_parameter(None)
    assert exercises.check_gpt3_activation_mb([358.6, 107.0, 6.3])
    assert not exercises.check_gpt3_activation_mb([578.8, 327.2, 50.3])   # TP without SP
    assert exercises.check_accumulation_factors(
        dict(params=1, grads=1, optimizer=1, activations=0.25), m=4)
    assert not exercises.check_accumulation_factors(
        dict(params=0.25, grads=1, optimizer=1, activations=0.25), m=4)
    assert not exercises.check_accumulation_factors({"params": 1}, m=4)
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == [
        "Right", "Not yet", "No answer yet", "Right", "Not yet", "Right", "Not yet", "Not yet"]
    with pytest.raises(ValueError, match="m .micro-batches. must be a whole number >= 1, got 0"):
        exercises.accumulation_factors(0)


def test_megatrons_refused_recompute_combinations():
    rows = lessons.recompute_field_rows()
    verdicts = [r["verdict"].split(":")[0] for r in rows]
    assert verdicts == ["accepted"] * 4 + ["refused"] * 3 + ["accepted; train_gpt.py refuses "
                                                          "its flags (as Megatron-LM does)",
                                                          "refused"]
    text = lessons.format_field_rows(rows)
    assert max(len(line) for line in text.splitlines()) <= 100


def test_the_recompute_table_is_measured_equal_to_the_terms_and_the_flops_formula(world):
    rows = lessons.recompute_rows(TINY, 2)
    assert all(r["saved"] == r["derived"] and r["flops"] == r["formula"] for r in rows.values())
    assert rows["full"]["saved"] < rows["selective"]["saved"] < rows["none"]["saved"]


def test_a_bad_shape_is_refused_naming_the_values():
    with pytest.raises(ValueError, match=r"hidden \(10\) must be a multiple of heads \(4\)"):
        lessons.Shape(1, 10, 4, 8, 16)
    with pytest.raises(ValueError, match="layers must be a whole number >= 1, got 0"):
        lessons.Shape(0, 8, 2, 4, 16)
