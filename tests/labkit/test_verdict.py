"""The labs' checks say right, wrong or not yet, and accept what a learner types
(mpu_lab.labkit.verdict and each lab's exercises), no processes."""
import pathlib

import pytest

from mpu_lab.labkit.tp_mappings import exercises
from mpu_lab.labkit.rank_groups import exercises as rank_groups_exercises
from mpu_lab.labkit.column_parallel import exercises as column_parallel_exercises
from mpu_lab.labkit.pipeline_parallel import exercises as pipeline_parallel_exercises
from mpu_lab.labkit.row_parallel import exercises as row_parallel_exercises
from mpu_lab.labkit.parallel_transformer import exercises as parallel_transformer_exercises
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
    # lab 11's: m = 4 < p - r = 5 caps it; interleaved: warm-up 2(p-1) + (v-1)p = 22, then the
    # steady state's first forward (Megatron-core's get_pp_rank_microbatches)
    (lambda a: pipeline_parallel_exercises.check_peak_in_flight(a, "1f1b", 8, 4, stage=3), 4, 5),
    (lambda a: pipeline_parallel_exercises.check_peak_in_flight(a, "interleaved", 8, 32, 0, v=2),
     23, 22),
    # Megatron-core's _VocabParallelCrossEntropy.backward issues no collective
    (lambda a: parallel_transformer_exercises.check_ce_backward_collectives(a), 0, 3),
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


def test_a_check_shows_its_answer_only_after_the_second_wrong_answer(capsys):
    # p = 4 stages, m = 8 micro-batches: the bubble is 3 of 11 slots (worked by hand)
    share = pipeline_parallel_exercises.check_bubble_share
    assert not share(None, 4, 8) and not share(0.5, 4, 8)
    first = capsys.readouterr().out
    assert "3/11" not in first and "The answer" not in first
    assert not share(3 / 8, 4, 8)
    second = capsys.readouterr().out.splitlines()
    assert second[0].startswith("Not yet:") and "3/11" not in second[0]
    assert second[1].startswith("The answer, after 2 tries: 3/11 = 0.273")
    # another question keeps its own count; a right answer still says Right
    assert not share(0.5, 4, 8, v=2)
    assert "The answer" not in capsys.readouterr().out
    assert share(3 / 11, 4, 8) and capsys.readouterr().out.startswith("Right: 3/11")
    verdict.forget_tries()
    assert not share(0.5, 4, 8) and "The answer" not in capsys.readouterr().out


def test_no_lab_keeps_a_written_answer_block():
    """Answers come from the checks after wrong tries, from reveal cells the learner runs, or
    from labs/solutions files loaded by hand: none sits, collapsed or not, in a lab's prose."""
    import json
    for path in sorted((REPO / "labs").glob("[0-9][0-9]_*.ipynb")) + [REPO / "Start_Here.ipynb"]:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                assert "<details" not in "".join(cell["source"]), f"{path.name} cell {i}"


def test_a_special_wrong_answer_counts_for_its_own_question_and_a_check_of_results_never_reveals(
        capsys):
    # two transposed shapes (a hint of their own) to two different questions: no answer yet
    assert not column_parallel_exercises.check_column_weight_shape((1024, 192), 1024, 768, 4)
    assert not row_parallel_exercises.check_row_weight_shape((256, 512), 1024, 512, 4)
    assert "The answer" not in capsys.readouterr().out
    # the second wrong answer to the row question, by another road: now its answer, (512, 256)
    assert not row_parallel_exercises.check_row_weight_shape((1, 1), 1024, 512, 4)
    assert "The answer, after 2 tries: each rank stores weight (512, 256)" in capsys.readouterr().out
    for _ in range(3):
        verdict.verdict(False, "all 8 ranks agree", "some differ", reveal=False)
    assert "The answer" not in capsys.readouterr().out
