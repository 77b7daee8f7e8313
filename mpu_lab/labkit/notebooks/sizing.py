"""How long each lab takes: its core (everything before the first "Going further" heading) and
its optional depth, counted from the notebook, and the compute its cells took when the lab was
last re-executed here (``regenerate`` records it in ``labs/compute_times.json`` with the
machine).

A lab's time is an estimate built from measured parts, and says so (issue 38 item 4: count what
a learner reads and writes, not only the prose):

* reading, at :data:`WORDS_PER_MINUTE`: the words of the markdown and the code cells, and the
  words of the stored text outputs a learner reads (``text/plain`` and ``stdout``; not
  ``stderr``, not the ``text/plain`` stand-in of a figure, not the outputs of a cell tagged
  with one of :data:`UNREAD_OUTPUT_TAGS` or collapsed, ``metadata.jupyter.outputs_hidden``;
  a cell tagged ``nbval-ignore-output`` is read like any other: the tag only keeps nbval from
  comparing it);
* :data:`MINUTES_PER_FIGURE` per stored figure (an ``image/png`` output): a plot is looked at,
  its axes and legend read, and compared with the prose;
* a write-the-code exercise (a ``grade(`` call) by the size of what the learner writes: the
  logic lines (not blank, comment or docstring) of the solution functions of the learner's
  functions it grades, in ``labs/solutions/NN_topic.py``
  (:mod:`~mpu_lab.labkit.notebooks.solutions`), at :func:`exercise_minutes` = 3 min (read the
  stub, its docstring and the hint, run the grader) + 1 min per 2 logic lines (write a line of
  distributed code, and fix it once after a "Not yet" verdict); :data:`MINUTES_PER_EXERCISE`
  where no solution names the function;
* :data:`MINUTES_PER_QUESTION` for a question checked by ``check_*``;
* the cells' compute, as measured.

Start_Here prints the table; the core of each lab is meant to stay within
:data:`CORE_BUDGET_MIN`.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import os
import pathlib
import platform
import re
import textwrap
from typing import Dict, List, Optional, Sequence

from mpu_lab.labkit import REPO_ROOT
from mpu_lab.labkit.notebooks import solutions, stopwatch
from mpu_lab.labkit.notebooks.selection import lab_paths

WORDS_PER_MINUTE = 120        # technical prose with formulas and code, read to be understood
MINUTES_PER_EXERCISE = 10     # a write-the-code exercise whose solution is not on file
EXERCISE_BASE_MIN = 3         # read the stub and the hint, run the grader
LOGIC_LINES_PER_MINUTE = 2    # write a line of distributed code, fix it once
MINUTES_PER_QUESTION = 2      # a predicted number or shape, checked
MINUTES_PER_FIGURE = 1        # look at a plot, read its axes and legend
CORE_BUDGET_MIN = 45          # one sitting
UNREAD_OUTPUT_TAGS = frozenset({"remove-output", "hide-output", "remove-cell", "hide-cell"})
TIMES_FILE = REPO_ROOT / "labs" / "compute_times.json"
_WORD = re.compile(r"[A-Za-z0-9_$\\]+")
# what a reader skips in markdown: a link's target (its text is read), a bare URL, an HTML tag
_UNREAD = re.compile(r"(?<=\])\([^)\s]*\)|https?://\S+|</?[A-Za-z][^>\n]*>")
_HEADING = re.compile(r"^(#{1,2})\s+(.+)$", re.M)
_GRADED = re.compile(r"\bgrade\(\s*(\([^()]*\)|[A-Za-z_]\w*)")


@dataclasses.dataclass
class Parts:
    """What a learner spends time on in one cell, or a run of cells: words read (source and
    stored outputs), figures looked at, write-the-code exercises (and their minutes) and
    questions."""

    words: int = 0
    output_words: int = 0
    figures: int = 0
    exercises: int = 0
    exercise_min: float = 0.0
    questions: int = 0

    def __iadd__(self, other: "Parts") -> "Parts":
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))
        return self

    @property
    def minutes(self) -> float:
        """Reading, figures, exercises and questions (compute left out)."""
        return ((self.words + self.output_words) / WORDS_PER_MINUTE
                + MINUTES_PER_FIGURE * self.figures + self.exercise_min
                + MINUTES_PER_QUESTION * self.questions)


@dataclasses.dataclass
class LabSize:
    """One lab's parts in its core and in its optional depth, and its measured compute."""

    name: str
    core: Parts
    extra: Parts
    compute_s: Optional[float]

    @property
    def core_words(self) -> int:
        return self.core.words

    @property
    def extra_words(self) -> int:
        return self.extra.words

    @property
    def exercises(self) -> int:
        return self.core.exercises

    @property
    def questions(self) -> int:
        return self.core.questions

    @property
    def core_minutes(self) -> float:
        """The core's reading, figures, exercises and questions, and the measured compute of
        the whole notebook."""
        return self.core.minutes + (self.compute_s or 0.0) / 60

    @property
    def extra_minutes(self) -> float:
        """Reading, figures, exercises and questions of the "Going further" sections."""
        return self.extra.minutes


def exercise_minutes(logic_lines: int) -> float:
    """Minutes for a write-the-code exercise whose solution has ``logic_lines`` lines of logic:
    :data:`EXERCISE_BASE_MIN` + one minute per :data:`LOGIC_LINES_PER_MINUTE` lines."""
    return EXERCISE_BASE_MIN + logic_lines / LOGIC_LINES_PER_MINUTE


def _body_lines(source: str, fn: ast.FunctionDef) -> int:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]                  # the docstring is the exercise's, not the learner's
    lines = source.splitlines()
    numbers = {n for node in body for n in range(node.lineno, node.end_lineno + 1)}
    return sum(1 for n in numbers if lines[n - 1].strip()
               and not lines[n - 1].strip().startswith("#"))


def solution_logic_lines(lab: str) -> Dict[str, int]:
    """``{learner's function: logic lines of its solution}`` for lab ``lab`` ("11"), from its
    file in ``labs/solutions/`` (empty when the lab has none)."""
    if lab not in solutions.SOLUTIONS:
        return {}
    source = solutions.solution_source(lab)
    fns = {n.name: n for n in ast.walk(ast.parse(source))
           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return {learner: _body_lines(source, fns[sol])
            for learner, sol in solutions.SOLUTIONS[lab].names.items() if sol in fns}


def _graded_minutes(source: str, lines: Dict[str, int]) -> List[float]:
    """Minutes of each ``grade(`` call in a cell: by the solutions of the functions it grades
    (its first argument, one name or a tuple of them)."""
    out = []
    for m in _GRADED.finditer(source):
        names = re.findall(r"[A-Za-z_]\w*", m.group(1))
        known = [lines[n] for n in names if n in lines]
        out.append(exercise_minutes(sum(known)) if known else MINUTES_PER_EXERCISE)
    return out


def _words(source: str, markdown: bool = False) -> int:
    if markdown:
        source = _UNREAD.sub(" ", source)
    return len(_WORD.findall(source))


def _joined(text) -> str:
    return "".join(text) if isinstance(text, list) else (text or "")


def _read_outputs(cell) -> tuple:
    """(words, figures) of a code cell's stored outputs that a learner reads."""
    meta = cell.get("metadata", {})
    if UNREAD_OUTPUT_TAGS & set(meta.get("tags", [])) or meta.get("jupyter", {}).get(
            "outputs_hidden"):
        return 0, 0
    words = figures = 0
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            words += _words(_joined(out.get("text"))) if out.get("name") == "stdout" else 0
            continue
        data = out.get("data", {})
        if "image/png" in data:
            figures += 1                 # its text/plain is a stand-in nobody reads
        elif "text/plain" in data:
            words += _words(_joined(data["text/plain"]))
    return words, figures


def _cell_parts(cell, lines: Optional[Dict[str, int]] = None) -> Parts:
    """What one cell costs a learner; a parameters cell counts nothing."""
    if cell.cell_type == "code" and "parameters" in cell.metadata.get("tags", []):
        return Parts()
    if cell.cell_type != "code":
        return Parts(words=_words(cell.source, markdown=cell.cell_type == "markdown"))
    graded = _graded_minutes(cell.source, lines or {})
    output_words, figures = _read_outputs(cell)
    return Parts(_words(cell.source), output_words, figures, len(graded), sum(graded),
                 len(re.findall(r"\bcheck_\w+\(", cell.source)))


def lab_size(path: pathlib.Path, compute: Optional[Dict[str, float]] = None) -> LabSize:
    """Count one notebook's parts (module docstring) before and after the first "Going
    further" heading."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    lines = solution_logic_lines(path.name[:2])
    core, extra = Parts(), Parts()
    in_core = True
    for cell in nb.cells:
        if cell.cell_type == "markdown" and stopwatch.GOING_FURTHER.search(cell.source):
            in_core = False
        if in_core:
            core += _cell_parts(cell, lines)
        else:
            extra += _cell_parts(cell, lines)
    return LabSize(path.stem, core, extra, (compute or {}).get(path.stem))


def section_minutes(path: pathlib.Path) -> List[tuple]:
    """``[(heading, minutes)]`` for each ``#``/``##`` section of one notebook, compute left out:
    where a lab's reading, figures and exercises go, to see which depth could move to "Going
    further"."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    lines = solution_logic_lines(path.name[:2])
    sections = [["(before the title)", 0.0]]
    for cell in nb.cells:
        heading = _HEADING.search(cell.source) if cell.cell_type == "markdown" else None
        if heading:
            sections.append([heading.group(2).strip(), 0.0])
        sections[-1][1] += _cell_parts(cell, lines).minutes
    return [(name, minutes) for name, minutes in sections if minutes or name != sections[0][0]]


def load_compute_times(path: pathlib.Path = TIMES_FILE) -> Dict[str, float]:
    """``{lab stem: seconds}`` from the last re-execution here (empty when none is recorded)."""
    if not path.exists():
        return {}
    return {k: float(v) for k, v in json.loads(path.read_text())["seconds"].items()}


def record_compute_times(seconds: Dict[str, float], path: pathlib.Path = TIMES_FILE) -> None:
    """Merge ``{notebook name: seconds}`` of a re-execution into the file, with the machine."""
    old = json.loads(path.read_text()) if path.exists() else {"seconds": {}}
    for name, value in seconds.items():
        old["seconds"][pathlib.Path(name).stem] = round(value)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    old["machine"] = f"{cores} CPU cores, {platform.machine()}, Python {platform.python_version()}"
    old["seconds"] = dict(sorted(old["seconds"].items()))
    path.write_text(json.dumps(old, indent=1) + "\n")


def lab_sizes(labs: Optional[Sequence[pathlib.Path]] = None) -> List[LabSize]:
    paths = labs or lab_paths()
    compute = load_compute_times()
    return [lab_size(p, compute) for p in paths]


def format_lab_sizes(sizes: Sequence[LabSize], measured: Optional[Dict[str, tuple]] = None,
                     measured_title: str = "measured") -> str:
    """The table Start_Here prints (lines of at most 100 characters): one row per lab, the
    core's parts and estimate, then (where a stopwatch file holds any) the minutes measured
    while working through the core, and the optional depth last."""
    measured = measured or {}
    shown = f" {measured_title:>11}" if measured else ""
    lines = [f"{'lab':<23} {'words':>5} {'output':>6} {'figs':>4} {'exercises':>9} "
             f"{'questions':>9} {'compute':>7} {'core, est.':>10}{shown} {'further':>7}"]
    for s in sizes:
        compute = "n/a" if s.compute_s is None else f"{s.compute_s / 60:.1f} min"
        extra = f"+{s.extra_minutes:.0f} min" if s.extra_minutes else "-"
        work = f"{s.core.exercises}: {s.core.exercise_min:.0f} min" if s.core.exercises else "-"
        mine = ""
        if measured:
            minutes, learners = measured.get(s.name, (None, 0))
            mine = f" {'-':>11}" if minutes is None else \
                f" {f'{minutes:.0f} min' + (f' ({learners})' if learners > 1 else ''):>11}"
        lines.append(f"{s.name:<23} {s.core.words:>5,} {s.core.output_words:>6,} "
                     f"{s.core.figures:>4} {work:>9} {s.core.questions:>9} {compute:>7} "
                     f"{s.core_minutes:>6.0f} min{mine} {extra:>7}")
    return "\n".join(lines)


def print_lab_sizes(labs: Optional[Sequence[pathlib.Path]] = None,
                    times: Optional[Sequence[pathlib.Path]] = None) -> None:
    """Start_Here's table. ``times``: stopwatch files (one per learner) whose median is shown;
    by default this learner's own file, where it exists."""
    sizes = lab_sizes(labs)
    machine = (json.loads(TIMES_FILE.read_text()).get("machine", "this machine")
               if TIMES_FILE.exists() else "no machine yet")
    own = stopwatch.log_path()   # not under nbval or papermill, which turn the stopwatch off
    files = list(times) if times else [own] if stopwatch.enabled() and own.exists() else []
    measured = stopwatch.median_minutes(files)
    title = "yours" if not times else "measured"
    print(format_lab_sizes(sizes, measured, title))
    print(f"\ncore, est. = (words + output words read) / {WORDS_PER_MINUTE} per minute\n"
          f"  + {MINUTES_PER_FIGURE} min per figure\n"
          f"  + per write-the-code exercise {EXERCISE_BASE_MIN} min + 1 min per "
          f"{LOGIC_LINES_PER_MINUTE} logic lines of its solution\n"
          f"  + {MINUTES_PER_QUESTION} min per question\n"
          f"  + the compute, measured when the lab was last re-executed\n    ({machine}).")
    if measured:
        whose = ("your own sittings" if not times else
                 f"the median over {len(files)} learners' files (how many worked through it)")
        print(f"{title} = the active minutes from a lab's first cell to the last cell of its "
              f"core,\n  pauses over {stopwatch.BREAK_S // 60} min left out: {whose}.")
    over = [s for s in sizes if s.core_minutes > CORE_BUDGET_MIN]
    # each lab with its excess kept on one line (a no-break space until wrapped)
    said = ", ".join(f"{s.name}\xa0(+{s.core_minutes - CORE_BUDGET_MIN:.1f}\xa0min)" for s in over)
    print(textwrap.fill(f"cores over {CORE_BUDGET_MIN} min: {said or 'none'}; total of the "
                        f"cores {sum(s.core_minutes for s in sizes) / 60:.1f} h", 100,
                        subsequent_indent="  ").replace("\xa0", " "))
