"""The labs' checks say right, wrong or not yet, and accept what a learner types
(mpu_lab.labkit.verdict and each lab's exercises), no processes."""
import pathlib

import pytest

from mpu_lab.labkit.tp_mappings import exercises
from mpu_lab.labkit.rank_groups import exercises as rank_groups_exercises
from mpu_lab.labkit.column_parallel import exercises as column_parallel_exercises
from mpu_lab.labkit.pipeline_parallel import exercises as pipeline_parallel_exercises
from mpu_lab.labkit.row_parallel import exercises as row_parallel_exercises
from mpu_lab.labkit import verdict
from mpu_lab.labkit.verdict import Verdict

REPO = pathlib.Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- exercises
@pytest.mark.parametrize("check,right,wrong", [
    (lambda a: rank_groups_exercises.check_group_of_rank(a, 6, "dp", 32, 4, 2), [2, 6, 10, 14], [2, 6, 10]),
    (lambda a: rank_groups_exercises.check_crossing_count(a, "tp", 24, 4, 2, gpus_per_node=6), 2, 0),
    (lambda a: column_parallel_exercises.check_column_weight_shape(a, 1024, 768, 4), (192, 1024), (1024, 192)),
    (lambda a: column_parallel_exercises.check_strided_rows(a, 1, 24, 4, 3), [2, 3, 10, 11, 18, 19], [6, 7, 8, 9, 10, 11]),
    (lambda a: row_parallel_exercises.check_row_weight_shape(a, 1024, 512, 4), (512, 256), (256, 512)),
    (lambda a: row_parallel_exercises.check_mlp_all_reduces(a), (1, 1), (2, 2)),
    (lambda a: exercises.check_all_reduce_of_ranks(a, 5, 8, 2, 4), 9, 22),
    (lambda a: exercises.check_gather_split(a, 3, 8, 4, 2), [float(v) for v in range(4) for _ in range(8)],
     [3.0] * 32),
    (lambda a: pipeline_parallel_exercises.check_bubble_share(a, 4, 8), 3 / 11, 3 / 8),
    (lambda a: pipeline_parallel_exercises.check_bubble_share(a, 4, 8, v=2), 3 / 19, 3 / 11),
    (lambda a: pipeline_parallel_exercises.check_peak_in_flight(a, "1f1b", 4, 8), 4, 8),
    (lambda a: pipeline_parallel_exercises.check_peak_in_flight(a, "gpipe", 4, 8), 8, 4),
    (lambda a: pipeline_parallel_exercises.check_peak_in_flight(a, "1f1b", 4, 8, stage=3), 1, 4),
])
def test_each_check_says_right_wrong_or_not_yet(capsys, check, right, wrong):
    assert check(right) and capsys.readouterr().out.startswith("Right:")
    assert not check(wrong) and capsys.readouterr().out.startswith("Not yet:")
    assert not check(None) and capsys.readouterr().out.startswith("No answer yet:")


def test_checks_accept_tensors_and_sizes_and_explain_transposed_shapes(capsys):
    import torch
    assert column_parallel_exercises.check_column_weight_shape(torch.Size([256, 1024]), 1024, 512, 2)
    assert exercises.check_gather_split(torch.tensor([0.0] * 8 + [1.0] * 8), 1, 8, 2, 4)
    capsys.readouterr()
    column_parallel_exercises.check_column_weight_shape([1024, 256], 1024, 512, 2)
    assert "F.linear computes X W^T" in capsys.readouterr().out
    rank_groups_exercises.check_group_of_rank([14, 10, 6, 2], 6, "dp", 32, 4, 2)
    assert "the right ranks, but Megatron lists them as [2, 6, 10, 14]" in capsys.readouterr().out


def test_checks_reject_junk_without_raising(capsys):
    assert not rank_groups_exercises.check_crossing_count("two", "tp", 24, 4, 2, gpus_per_node=6)
    assert not column_parallel_exercises.check_column_weight_shape("256x1024", 1024, 512, 2)
    assert not exercises.check_gather_split(3, 1, 8, 2, 4)
    assert not rank_groups_exercises.check_crossing_count(True, "tp", 16, 2, 4)


def test_verdict_is_truthy_compares_with_bool_and_shows_nothing_in_a_notebook():
    assert Verdict(True) == True and Verdict(False) == False  # noqa: E712
    assert bool(Verdict(True)) and not Verdict(False)
    assert repr(Verdict(True)) == "Verdict(True)"
    assert Verdict(True)._ipython_display_() is None
    assert verdict.summarize([Verdict(True), Verdict(False), True]) == "2 of 3 right"
