"""Solutions never run on Run All and never take the learner's name (issue 27, item 2).

The committed labs are read as they are stored (no kernel): no stored output holds a grader's
"Right: ... agrees" verdict, no cell defines a learner's function other than as the stub that
raises NotImplementedError, and no cell defines a solution. Each lab's solution file defines its
solutions under their own names and nothing under the learner's, and the lab tells the learner
how to load it. The check itself (``notebooks.solutions.exercise_problems``) is shown to catch
each kind of slip on notebooks built here by hand.
"""
import ast
import importlib
import re

import nbformat
import pytest

from mpu_lab.labkit import REPO_ROOT
from mpu_lab.labkit.notebooks import structure_problems
from mpu_lab.labkit.notebooks.solutions import (
    LEARNER_NAMES,
    SOLUTIONS,
    exercise_problems,
    solution_source,
)

LABS = sorted((REPO_ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))
# Written here, apart from the module's own pattern: any grader verdict "Right: <name> ... agrees".
STORED_VERDICT = re.compile(r"\bRight: \w+.*agrees")


def _outputs(cell):
    for out in cell.get("outputs", []):
        text = out.get("text", "") or out.get("data", {}).get("text/plain", "")
        yield "".join(text) if isinstance(text, list) else text


def _defined(source):
    lines = ["" if ln.lstrip().startswith(("%", "!")) else ln for ln in source.splitlines()]
    return {n.name: n for n in ast.walk(ast.parse("\n".join(lines)))
            if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.name[:2])
def test_no_stored_output_holds_a_graders_right_verdict(path):
    nb = nbformat.read(path, as_version=4)
    found = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
             and any(STORED_VERDICT.search(t) for t in _outputs(c))]
    assert found == [], f"{path.name}: cells {found} store a 'Right: ... agrees' verdict"


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.name[:2])
def test_no_cell_defines_a_solution_or_the_learners_function_with_a_body(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for name, fn in _defined(cell.source).items():
            assert not name.startswith("solution_"), f"{path.name} cell {i} defines {name}"
            if name in LEARNER_NAMES:
                body = ast.unparse(fn)
                assert "raise NotImplementedError" in body, \
                    f"{path.name} cell {i} defines the learner's {name} with a body"
    assert exercise_problems(nb) == []


@pytest.mark.parametrize("lab", sorted(SOLUTIONS))
def test_each_solution_file_holds_its_solutions_under_their_own_names(lab):
    solution = SOLUTIONS[lab]
    tree = ast.parse(solution_source(lab))     # what the file defines at its top level (a
    defined = {n.name for n in tree.body       # solution may hold its own helpers inside)
               if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert set(defined) == set(solution.names.values())
    assert not set(defined) & LEARNER_NAMES
    for learner, own in solution.names.items():
        assert own.startswith(("solution_", "Solution")) and own != learner   # a class: Solution...


@pytest.mark.parametrize("lab", sorted(SOLUTIONS))
def test_each_lab_tells_the_learner_how_to_load_its_solution(lab):
    path = next((REPO_ROOT / "labs").glob(f"{lab}_*.ipynb"))
    nb = nbformat.read(path, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert f"%load solutions/{SOLUTIONS[lab].file}" in text
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "%load" not in code          # loading it stays the learner's own act


def _notebook(*cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    return nb


def _code(source, output=None):
    cell = nbformat.v4.new_code_cell(source, execution_count=1)
    if output is not None:
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=output)]
    return cell


STUB = '''def my_column_forward(x, weight_shard, bias_shard, gather_output):
    raise NotImplementedError("write it")'''
ANSWERED = '''def my_column_forward(x, weight_shard, bias_shard, gather_output):
    return gather_from_tensor_model_parallel_region(x @ weight_shard.t() + bias_shard)'''


def test_the_check_passes_the_stub_and_its_no_answer_yet():
    nb = _notebook(_code(STUB), _code("exercises.grade(my_column_forward, C, world)",
                                      "No answer yet: my_column_forward still raises ..."))
    assert exercise_problems(nb) == []


def test_the_check_flags_a_stored_solution_verdict():
    nb = _notebook(_code("grade(f, C, world)", "Right: my_column_forward agrees with the "
                                               "reference on all 2 ranks for 6 inputs"))
    assert exercise_problems(nb) == ["cell 0 stores a grader's 'Right:' verdict (a solution ran "
                                     "on Run All): keep solutions in labs/solutions/, loaded "
                                     "with %load"]


def test_the_check_flags_a_solution_under_the_learners_name_and_a_solution_cell():
    nb = _notebook(_code(ANSWERED), _code("%%ranks\ndef solution_step(p):\n    return p"))
    problems = exercise_problems(nb)
    assert len(problems) == 2
    assert problems[0].startswith("cell 0 defines the learner's my_column_forward with a body")
    assert problems[1].startswith("cell 1 defines solution_step: a solution runs on Run All")


def test_the_notebook_check_reports_no_exercise_problem():
    assert [p for p in structure_problems() if "solution" in p or "'Right:'" in p] == []


def test_an_unknown_lab_has_no_solution_file():
    labs = ", ".join(repr(lab) for lab in sorted(SOLUTIONS))
    assert "'14'" not in labs and "'01'" in labs
    with pytest.raises(ValueError, match=re.escape(f"lab '14' has no solution file; labs with "
                                                   f"one: [{labs}]")):
        solution_source("14")


# `grader.grade(solution_x, exercises.NAME, world)` as a lab's prose and its solution file's
# header show it: every name must be what the lab's own code cells define or import.
GRADE_LINE = re.compile(r"(\w+)\.grade\((?:\(([^)]*)\)|(\w+)),\s*([\w.]+)")


def _grading_lines(text):
    return [(m.group(1), m.group(2) or m.group(3), m.group(4))
            for m in GRADE_LINE.finditer(text.replace("\n#", " "))]


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_the_shown_command_that_grades_a_solution_names_what_exists(lab):
    nb = nbformat.read(lab, as_version=4)
    imported = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        lines = ["" if ln.lstrip().startswith(("%", "!")) else ln
                 for ln in cell.source.splitlines()]
        try:
            tree = ast.parse("\n".join(lines))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    solution_file = REPO_ROOT / "labs" / "solutions" / f"{lab.stem}.py"
    texts = [c.source for c in nb.cells if c.cell_type == "markdown"]
    if solution_file.exists():
        texts.append(solution_file.read_text())
    solutions = ({n.name for n in ast.walk(ast.parse(solution_file.read_text()))
                  if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                 if solution_file.exists() else set())
    shown = [line for text in texts for line in _grading_lines(text)]
    for receiver, names, target in shown:
        for name in re.findall(r"\w+", names):
            assert name in solutions, f"{lab.name}: {name} is not in {solution_file.name}"
        alias, _, attribute = target.partition(".")
        for used, what in ((receiver, "grade"), (alias, attribute.split(".")[0])):
            assert used in imported, f"{lab.name}: {used}.{what} shown, {used} not imported"
            assert hasattr(importlib.import_module(imported[used]), what), \
                f"{lab.name}: {used}.{what} does not exist"
