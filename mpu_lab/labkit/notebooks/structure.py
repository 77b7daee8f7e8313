"""Structure checks of the committed notebooks, no kernel: what would break nbval, papermill or a
learner (stored errors, unexecuted cells, broken links, missing objectives or footer...)."""
from __future__ import annotations

import ast
import pathlib
import re
from typing import Dict, List, Tuple

from mpu_lab.labkit import REPO_ROOT
from mpu_lab.labkit.notebooks.selection import parameter_cells, notebook_paths
from mpu_lab.labkit.notebooks.solutions import exercise_problems

# A notebook cell holds at most a few lines of logic: longer code belongs in mpu_lab, where the
# tests reach it and a learner reads it as one named function.
MAX_LOGIC_LINES = 10
# A stored output line a learner reads without wrapping or scrolling sideways (issue 38 item 5).
MAX_OUTPUT_LINE = 100
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_TRACEBACK = "Traceback (most recent call last)"
# A prediction question: "Predict" as an imperative (at a line or sentence start, or in bold).
_PREDICT = re.compile(r"(^|[.!?]\s+|\*\*|_)Predict\b", re.M)
# A cell where the learner commits to an answer before anything reveals it: an answer left as
# None, a function stub, or the check / grader call itself.
_COMMIT = re.compile(r"=\s*None\b|NotImplementedError|\bcheck_\w+\(|\bgrade\(")
REVEAL = "reveal"          # tag: the cell shows a prediction's answer; stored without outputs
WRITE_THE_CODE_LABS = ("01", "02", "03", "05", "06", "07", "08", "09", "10", "11", "12", "13")   # each grades a learner's function


def lesson_problems(nb, lab_number: str = "") -> List[str]:
    """What would spoil or weaken a lesson: a prediction answered right under its question (the
    first code cell after a "Predict ..." cell must be where the learner commits, or a cell
    tagged ``reveal`` stored without outputs), a ``reveal`` cell with stored outputs or compared
    by nbval, a lab without an https link to a source, and (labs 01, 06, 07, 08, 09, 11) no write-the-code
    exercise graded by ``grade(...)``."""
    problems = []
    cells = nb.cells
    for i, cell in enumerate(cells):
        tags = cell.get("metadata", {}).get("tags", [])
        if cell.cell_type == "code" and REVEAL in tags:
            if cell.get("outputs"):
                problems.append(f"cell {i} is tagged {REVEAL!r} but stores outputs (the answer)")
            if "nbval-ignore-output" not in tags:
                problems.append(f"cell {i} is tagged {REVEAL!r} but not nbval-ignore-output")
        if cell.cell_type != "markdown" or not _PREDICT.search(cell.source):
            continue
        after = next((j for j in range(i + 1, len(cells)) if cells[j].cell_type == "code"), None)
        if after is None:
            continue
        nxt = cells[after]
        committed = _COMMIT.search(nxt.source) is not None
        hidden = REVEAL in nxt.get("metadata", {}).get("tags", []) and not nxt.get("outputs")
        if not (committed or hidden):
            problems.append(f"cell {after} answers the prediction asked in cell {i} in its stored "
                            f"output: let the learner commit first (answer = None and a check), "
                            f"or tag it {REVEAL!r} and store it without outputs")
    if lab_number:
        text = "\n".join(c.source for c in cells if c.cell_type == "markdown")
        if "https://" not in text:
            problems.append("no https link to a source (paper, Megatron-core file, seed document)")
        code = "\n".join(c.source for c in cells if c.cell_type == "code")
        if lab_number in WRITE_THE_CODE_LABS and not re.search(r"\bgrade\(", code):
            problems.append("no write-the-code exercise (a learner's function graded by grade(...))")
    return problems


def output_problems(nb) -> List[str]:
    """What an executed notebook must not store: an error output, or a printed traceback."""
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                problems.append(f"cell {i} stores an error output ({out.get('ename')})")
            text = out.get("text", "") or out.get("data", {}).get("text/plain", "")
            if isinstance(text, list):
                text = "".join(text)
            if _TRACEBACK in text:
                problems.append(f"cell {i} prints a traceback")
    return problems


def wide_output_lines(nb, limit: int = MAX_OUTPUT_LINE) -> List[Tuple[int, int, str]]:
    """``(cell, length, line)`` for each line of a stored text output (streams, ``text/plain``
    that is not a figure's stand-in) longer than ``limit`` characters, colour codes left out
    and tabs expanded: JupyterLab wraps or scrolls such a line, and a table in it no longer
    reads as one (issue 38 item 5)."""
    wide = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            text = out.get("text", "") or ("" if "image/png" in data
                                           else data.get("text/plain", ""))
            text = "".join(text) if isinstance(text, list) else text
            for line in _ANSI.sub("", text).expandtabs().splitlines():
                if len(line.rstrip()) > limit:
                    wide.append((i, len(line.rstrip()), line))
    return wide


def output_width_problems(nb, limit: int = MAX_OUTPUT_LINE) -> List[str]:
    """One problem per cell that stores output lines over ``limit`` characters: how many, and
    the longest."""
    cells: Dict[int, List[int]] = {}
    for cell, length, _ in wide_output_lines(nb, limit):
        cells.setdefault(cell, []).append(length)
    return [f"cell {i} prints {len(lengths)} line(s) over {limit} characters "
            f"(longest {max(lengths)}): cut the line, or print a table with shorter columns"
            for i, lengths in cells.items()]


def _logic_lines(source: str) -> int:
    """Lines of logic: not blank, comment, magic, or an import (imports are not logic)."""
    lines = source.splitlines()
    skip = set()
    try:
        tree = ast.parse("\n".join("" if ln.lstrip().startswith(("%", "!")) else ln
                                   for ln in lines))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                skip.update(range(node.lineno - 1, node.end_lineno))
    except SyntaxError:
        pass
    return sum(1 for i, line in enumerate(lines)
               if i not in skip and line.strip() and not line.strip().startswith(("#", "%")))


def _is_stub(source: str) -> bool:
    """A cell the learner fills: it defines what still raises NotImplementedError."""
    return "raise NotImplementedError" in source and re.search(r"^(def|class) ", source, re.M)


def heading_anchors(nb) -> List[str]:
    """The anchors JupyterLab and nbconvert give a notebook's headings (spaces become ``-``)."""
    anchors = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
                if m:
                    anchors.append(m.group(1).replace(" ", "-"))
    return anchors


def _links_ok(path: pathlib.Path, text: str) -> List[str]:
    """Relative links (and their ``#anchors`` into notebooks) that lead nowhere."""
    import nbformat

    bad = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # web links and in-page anchors
        file_part, _, anchor = target.partition("#")
        linked = path.parent / file_part
        if file_part and not linked.exists():
            bad.append(target)
        elif anchor and linked.suffix == ".ipynb":
            if anchor not in heading_anchors(nbformat.read(linked, as_version=4)):
                bad.append(target)
    return bad


def structure_problems(root=REPO_ROOT) -> List[str]:
    """What would break nbval, papermill or a learner, notebook by notebook (no kernel)."""
    import nbformat

    problems = []
    for path in notebook_paths(root):
        name = path.relative_to(root)
        try:
            nb = nbformat.read(path, as_version=4)
            nbformat.validate(nb)
        except Exception as exc:
            problems.append(f"{name}: not a valid notebook ({exc})")
            continue
        if "widgets" in nb.metadata:
            problems.append(f"{name}: saved widget state in metadata.widgets")
        if "papermill" in nb.metadata:
            problems.append(f"{name}: papermill metadata left in (run it through clean())")
        if nb.metadata.get("kernelspec", {}).get("name") != "python3":
            problems.append(f"{name}: kernelspec is not python3")
        problems += [f"{name}: {p}" for p in output_problems(nb)]
        problems += [f"{name}: {p}" for p in output_width_problems(nb)]
        problems += [f"{name}: {p}" for p in exercise_problems(nb)]
        is_lab = path.parent.name == "labs"
        problems += [f"{name}: {p}" for p in lesson_problems(nb, path.name[:2] if is_lab else "")]
        params = parameter_cells(nb)
        if is_lab and len(params) != 1:
            problems.append(f"{name}: {len(params)} cells tagged 'parameters' (need exactly one)")
        code_seen = False
        for i, cell in enumerate(nb.cells):
            tags = cell.get("metadata", {}).get("tags", [])
            if cell.cell_type == "markdown":
                problems += [f"{name}: cell {i} links to missing {t}"
                             for t in _links_ok(path, cell.source)]
                continue
            if cell.cell_type != "code":
                continue
            code_seen = True
            if cell.get("outputs") and cell.get("execution_count") is None:
                problems.append(f"{name}: cell {i} has outputs but no execution_count")
            if cell.get("execution_count") is None and "parameters" not in tags and cell.source.strip():
                problems.append(f"{name}: cell {i} was not executed")
            if ("parameters" not in tags and not _is_stub(cell.source)
                    and _logic_lines(cell.source) > MAX_LOGIC_LINES):
                problems.append(f"{name}: cell {i} has {_logic_lines(cell.source)} lines of logic "
                                f"(at most {MAX_LOGIC_LINES}; move it into mpu_lab)")
            if "interact" in cell.source and "nbval-ignore-output" not in tags:
                problems.append(f"{name}: cell {i} is interactive but not tagged nbval-ignore-output")
            if "elapsed_s" in cell.source and "nbval-ignore-output" not in tags:
                problems.append(f"{name}: cell {i} prints a timing but is compared by nbval")
        if is_lab:
            first = nb.cells[0] if nb.cells else None
            if (first is None or first.cell_type != "markdown"
                    or "learning objectives" not in first.source.lower()):
                problems.append(f"{name}: the first cell must state the learning objectives")
            last = nb.cells[-1] if nb.cells else None
            footer = last.source if last is not None and last.cell_type == "markdown" else ""
            for word in ("Previous", "Home", "Next"):
                if word not in footer:
                    problems.append(f"{name}: footer (last cell) lacks a {word!r} link")
            sources = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
            if "launcher.run(" not in sources and "start_world(" not in sources:
                problems.append(f"{name}: no torchrun job (mpu_lab.launcher.run) and no live "
                                f"world of ranks (playground.start_world)")
            if not re.search(r"\bcheck_\w+\(", sources):
                problems.append(f"{name}: no exercise check (check_...)")
            if not code_seen:
                problems.append(f"{name}: no code cells")
    return problems

