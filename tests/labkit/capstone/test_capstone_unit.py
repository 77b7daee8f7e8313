"""The capstone's checks before launch, its lines and verdicts (pure; no process starts), and
labs/solutions laid out as a finished learner's package."""
import ast
import pathlib
import shutil

import pytest

from mpu_lab.labkit.capstone.__main__ import main
from mpu_lab.labkit.capstone.run import piece_lines, verdict

SOLUTIONS = pathlib.Path(__file__).resolve().parents[3] / "labs" / "solutions"
OK = ["--code", str(SOLUTIONS), "--tensor-model-parallel-size", "2",
      "--pipeline-model-parallel-size", "2"]


def refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_labs_solutions_defines_each_parallel_linear_class_in_exactly_one_file():
    for name in ("ColumnParallelLinear", "RowParallelLinear"):
        files = [p.name for p in sorted(SOLUTIONS.glob("*.py"))
                 if any(isinstance(n, ast.ClassDef) and n.name == name
                        for n in ast.parse(p.read_text()).body)]
        assert files == ["layers.py"], (name, files)


def test_a_second_file_defining_row_parallel_linear_is_refused(tmp_path, capsys):
    code = tmp_path / "mine"
    shutil.copytree(SOLUTIONS, code)
    (code / "row.py").write_text("class RowParallelLinear:\n    pass\n")
    err = refused(["--code", str(code)] + OK[2:], capsys)
    assert "class RowParallelLinear is defined in 2 files (layers.py, row.py)" in err


@pytest.mark.parametrize("change, words", [
    (["--code", "/no/such/folder"], "--code /no/such/folder: no such folder"),
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 does not divide"),
    (["--pipeline-model-parallel-size", "0"], "--pipeline-model-parallel-size 0: a parallel"),
    (["--data-parallel-size", "64"], "= 256 ranks, more than this machine starts"),
    (["--train-iters", "1"], "--train-iters 1: use 2 to 50"),
    (["--tensor-model-parallel-size", "1", "--sequence-parallel"],
     "--sequence-parallel needs --tensor-model-parallel-size > 1"),
])
def test_a_run_that_cannot_work_is_refused_before_launch_naming_the_flag(change, words, capsys):
    assert words in refused(OK + change, capsys)


def test_a_file_that_is_not_python_is_refused(tmp_path, capsys):
    (tmp_path / "layers.py").write_text("class ColumnParallelLinear(:\n")
    assert "layers.py line 1 is not valid Python" in refused(["--code", str(tmp_path)] + OK[2:],
                                                              capsys)


def report(tp, dp, counts, runs, parting=None, verdicts=()):
    return {"tp_rank": tp, "dp_rank": dp, "pieces": ["checkpoint", "RowParallelLinear"],
            "found": {"RowParallelLinear": "layers.py"}, "counts": counts, "runs": runs,
            "first_parting": parting, "verdicts": list(verdicts), "tolerance": 1e-5}


def test_piece_lines_count_one_copy_of_the_model_and_name_the_missing():
    runs = {"mirror": {"loss": [4.0, 3.9], "grad_norm": [1.0, 0.9]},
            "learner": {"loss": [4.0, 3.9], "grad_norm": [1.0, 0.9]}}
    reports = [report(0, 0, {"RowParallelLinear": 4}, runs),
               report(1, 0, {"RowParallelLinear": 4}, runs),      # a tensor-parallel copy
               report(0, 0, {"RowParallelLinear": 2}, runs)]      # the next pipeline stage
    assert piece_lines(reports) == ["missing: checkpoint (the mirror's is used)",
                                    "used: layers.py:RowParallelLinear x6"]
    assert verdict(reports[0]) == (
        0, "capstone: losses equal the mirror's within 1e-05 over 2 iterations", None)


def test_the_verdict_names_the_first_iteration_and_piece_where_the_losses_part():
    runs = {"mirror": {"loss": [4.0, 3.9], "grad_norm": [1.0, 0.9]},
            "learner": {"loss": [4.0, 3.95], "grad_norm": [1.0, 0.9]}}
    code, line, culprit = verdict(report(0, 0, {}, runs, parting=[2, "loss"], verdicts=[
        {"piece": "RowParallelLinear", "file": "layers.py", "where": "training",
         "iteration": 2, "what": "loss"}]))
    assert code == 1 and culprit == "layers.py:RowParallelLinear"
    assert line.startswith("capstone: losses part from the mirror's at iteration 2 (yours "
                           "3.950000, the mirror's 3.900000): the piece is "
                           "layers.py:RowParallelLinear (swapped in alone, its losses part "
                           "at iteration 2)")


def test_a_gradient_norm_that_parts_with_equal_losses_is_a_parting_too():
    runs = {"mirror": {"loss": [4.0, 3.9], "grad_norm": [1.0, 0.9]},
            "learner": {"loss": [4.0, 3.9], "grad_norm": [2.0, 1.8]}}
    code, line, _ = verdict(report(0, 0, {}, runs, parting=[1, "grad_norm"]))
    assert code == 1 and line.startswith("capstone: gradient norms part from the mirror's at "
                                         "iteration 1 (yours 2.000000, the mirror's 1.000000)")
