"""Lab 18's lesson around the capstone (pure; no process starts): the survey of a learner's
package against a folder built by hand, the pieces the same as launch/capstone.py's (read from
its source, never imported), the broken piece a package the capstone accepts, the outcome
said from the numbers, and the questions' checks against answers worked by hand."""
import ast
import pathlib
import types

import pytest

from mpu_lab.labkit.capstone import exercises, lesson
from mpu_lab.labkit.capstone.args import class_definitions
from mpu_lab.labkit.capstone.run import CapstoneResult

LAUNCH = pathlib.Path(__file__).resolve().parents[3] / "launch" / "capstone.py"


def _assigned(name):
    """The value of a top-level assignment of launch/capstone.py, as written there."""
    tree = ast.parse(LAUNCH.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == name for t in n.targets))
    return ast.literal_eval(node.value)


def test_the_lessons_pieces_are_the_jobs_in_its_order():
    job = [("mappings.py", n) for n in _assigned("MAPPINGS")] + list(_assigned("MODEL_PIECES"))
    assert [(file, name) for file, name, _ in lesson.PIECES] == job


def _package(tmp_path):
    """A hand-built package: f in its own module, the row-parallel linear in a module of
    another name, a script named like a lab (not importable), a file that is not Python."""
    folder = tmp_path / "my_megatron"
    folder.mkdir()
    (folder / "mappings.py").write_text(
        "import torch\n\n\ndef copy_to_tensor_model_parallel_region(x):\n    return x\n")
    (folder / "row.py").write_text("class RowParallelLinear:\n    pass\n")
    (folder / "07_row_parallel.py").write_text("class ColumnParallelLinear:\n    pass\n")
    (folder / "random.py").write_text("def checkpoint(:\n")
    return folder


def test_the_survey_finds_each_piece_where_the_capstone_would_take_it(tmp_path):
    rows = {r.name: r for r in lesson.survey(_package(tmp_path))}
    assert len(rows) == 15
    assert rows["copy_to_tensor_model_parallel_region"].found_in == "mappings.py"
    assert rows["RowParallelLinear"].found_in == "row.py"            # defined elsewhere: found
    assert rows["ColumnParallelLinear"].found_in is None            # 07_...py is not a module
    assert rows["checkpoint"].found_in is None                       # random.py does not parse
    assert [r.name for r in rows.values() if r.found_in] == [
        "copy_to_tensor_model_parallel_region", "RowParallelLinear"]
    assert (rows["RowParallelLinear"].lab, rows["checkpoint"].lab) == ("07", "03")


def test_lab_11s_loop_stands_for_the_schedule_in_the_survey(tmp_path, capsys):
    folder = tmp_path / "my_megatron"
    folder.mkdir()
    (folder / "schedules.py").write_text("def my_1f1b_loop(stage, num_stages, m, f, b, p2p):\n"
                                         "    pass\n")
    rows = {r.name: r for r in lesson.print_survey(folder)}
    row = rows["forward_backward_pipelining_without_interleaving"]
    assert (row.found_in, row.found_as, row.lab) == ("schedules.py", "my_1f1b_loop", "11")
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "pipelining" in line][0].endswith("  yes: my_1f1b_loop")
    assert max(map(len, lines)) <= 100
    assert lines[-1].startswith("my_megatron/ holds 1 of the 15 pieces")


def test_an_absent_or_empty_folder_holds_nothing_and_says_so_alike(tmp_path, capsys):
    lesson.print_survey(tmp_path / "absent")
    absent = capsys.readouterr().out.splitlines()
    (tmp_path / "empty").mkdir()
    lesson.print_survey(tmp_path / "empty")
    empty = capsys.readouterr().out.splitlines()
    assert absent[-1] == "absent/ holds none of the 15 pieces yet: the run uses the mirror's for " \
                         "every one."
    assert len(absent) == len(empty) == 17 and empty[-1].startswith("empty/ holds none")
    lesson.print_survey(_package(tmp_path))
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ("my_megatron/ holds 2 of the 15 pieces; the run uses the mirror's for "
                       "the other 13.")
    assert any(line.startswith("RowParallelLinear ") and line.endswith("row.py") for line in out)
    assert max(len(line) for line in absent + out) <= 100


def test_the_broken_piece_is_one_class_in_layers_py_that_the_capstone_accepts(tmp_path):
    path = lesson.write_broken_row_parallel(tmp_path / "broken")
    assert path.name == "layers.py"
    assert class_definitions(path.parent) == {"RowParallelLinear": ["layers.py"]}
    assert [r.name for r in lesson.survey(path.parent) if r.found_in] == ["RowParallelLinear"]
    assert "reduce_from_tensor_model_parallel_region(" not in path.read_text()


def _result(code, mirror, learner, parting=None, culprit=None, used=0):
    lines = [f"used: layers.py:P{i} x1" for i in range(used)] + ["capstone: ..."]
    return CapstoneResult(code, lines, mirror, learner, parting, culprit)


def test_the_outcome_is_said_from_the_numbers(capsys):
    lesson.print_outcome(_result(0, [4.0, 3.9], [4.0, 3.9], used=2))
    lesson.print_outcome(_result(0, [4.0, 3.9], [4.0, 3.9]))
    lesson.print_outcome(_result(1, [4.0, 3.9], [4.1, 4.0], (1, "loss"), "layers.py:R"))
    lesson.print_outcome(_result(1, [4.0, 3.9], [4.0, 3.8], (1, "grad_norm"), None))
    lesson.print_outcome(_result(1, [], []))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "exit code 0: the 2 losses equal the mirror's, with 2 of your pieces in " \
                     "the model"
    assert out[1].startswith("exit code 0: the 2 losses equal the mirror's; none of the pieces")
    assert out[3] == "exit code 1: the loss parts first, at iteration 1; the piece named: " \
                     "layers.py:R"
    assert out[4] == "exit code 1: the gradient norm parts first, at iteration 1; the piece " \
                     "named: none on its own"
    assert out[5] == "exit code 1: the job failed before the losses could be compared"
    assert max(len(line) for line in out) <= 100


def test_the_long_verdict_is_wrapped_within_100_characters(capsys):
    verdict = ("capstone: losses part from the mirror's at iteration 1 (yours 4.153354, the "
               "mirror's 4.158387): the piece is layers.py:RowParallelLinear (swapped in alone, "
               "its losses part at iteration 1)")
    result = types.SimpleNamespace(lines=["missing: checkpoint (the mirror's is used)",
                                          "used: layers.py:RowParallelLinear x8", verdict])
    lesson.print_lines(result, missing=False)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "used: layers.py:RowParallelLinear x8"
    assert " ".join(part.strip() for part in out[1:]) == verdict
    assert max(len(line) for line in out) <= 100


@pytest.mark.parametrize("answer, ok", [(1, True), (1.0, True), (2, False), ("1", False)])
def test_a_forward_broken_piece_parts_at_the_first_iteration(answer, ok, capsys):
    assert bool(exercises.check_parting_iteration(answer)) is ok
    assert capsys.readouterr().out.startswith("Right:" if ok else "Not yet:")


def test_row_parallel_instances_counted_by_hand(capsys):
    # linear_proj and linear_fc2 in each of 2 layers per stage, on 2 stages: 2 * 2 * 2
    assert exercises.check_row_instances(8, 2)
    assert not exercises.check_row_instances(16, 2)     # the tensor-parallel copy counted again
    assert exercises.check_row_instances(16, 4)         # 4 stages
    assert not exercises.check_row_instances(None, 2)
    assert capsys.readouterr().out.splitlines()[-1].startswith("No answer yet:")


def test_the_model_the_lesson_prints_is_the_jobs(capsys):
    assert lesson.model_shape() == dict(zip(
        ["HIDDEN", "HEADS", "SEQ", "VOCAB", "MICRO_BATCH", "MICRO_BATCHES", "LR"],
        [32, 4, 16, 64, 2, 4, 3e-3]))
    # the job's layers: 2 per pipeline stage (its model_config)
    assert f"num_layers={lesson.LAYERS_PER_STAGE} * a.pipeline_model_parallel_size" in \
        LAUNCH.read_text()
    lesson.print_model(2)
    assert capsys.readouterr().out.startswith("capstone GPT: 4 layers (2 per stage), hidden "
                                              "size 32, 4 heads")
