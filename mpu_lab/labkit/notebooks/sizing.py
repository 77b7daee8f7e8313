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

**Builds** (issue 42): a write-the-code exercise is the learner's writing time, which depends on
the learner far more than reading does, so it is not part of the core's estimate; each is
reported on its own. A build is a section that opens with a markdown heading
``### Build: <piece>`` (:data:`BUILD_HEADING`) and runs to the next heading of level 1 to 3;
its minutes are those of the ``grade(`` calls inside it and the reading of its cells (the
contract, the stub, the verdict: read while writing, not in the core). A ``grade(`` call of the core outside
any such section is a build too, unmarked, named after the functions it grades. The core is
then reading and running (prose, outputs, figures, questions and the compute); a lab's builds
are printed beside it (:attr:`LabSize.build_minutes`, :attr:`LabSize.builds`). Writing in a
"Going further" section stays in that section's minutes.

Start_Here prints the table (:func:`print_lab_sizes`); the core of each lab is meant to stay
within :data:`CORE_BUDGET_MIN`.
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
# a build section's heading, and any heading that ends one (levels 1 to 3)
BUILD_HEADING = re.compile(r"^###\s+Build:\s*(.+?)\s*$", re.M)
_ENDS_BUILD = re.compile(r"^#{1,3}\s", re.M)
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
    def reading_minutes(self) -> float:
        """Reading, figures and questions: the writing of exercises and the compute left out."""
        return ((self.words + self.output_words) / WORDS_PER_MINUTE
                + MINUTES_PER_FIGURE * self.figures + MINUTES_PER_QUESTION * self.questions)

    @property
    def minutes(self) -> float:
        """Reading, figures, exercises and questions (compute left out)."""
        return self.reading_minutes + self.exercise_min


@dataclasses.dataclass
class Build:
    """One build of a lab's core: ``name`` (the ``### Build:`` heading's text, or the graded
    functions' names where no heading marks it), its write-the-code ``exercises`` and their
    estimated writing ``minutes``; ``marked``: it has its heading."""

    name: str
    exercises: int = 0
    minutes: float = 0.0
    marked: bool = True


@dataclasses.dataclass
class LabSize:
    """One lab's parts in its core and in its optional depth, and its measured compute."""

    name: str
    core: Parts
    extra: Parts
    compute_s: Optional[float]
    builds: List[Build] = dataclasses.field(default_factory=list)

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
        """The core's reading and running: its words, outputs, figures and questions, and the
        measured compute of the whole notebook; the builds' writing is not in it."""
        return self.core.reading_minutes + (self.compute_s or 0.0) / 60

    @property
    def build_minutes(self) -> float:
        """The estimated writing time of the core's builds, all together."""
        return sum(b.minutes for b in self.builds)

    @property
    def extra_minutes(self) -> float:
        """Reading, figures, exercises and questions of the "Going further" sections."""
        return self.extra.minutes


def exercise_minutes(logic_lines: int) -> float:
    """Minutes for a write-the-code exercise whose solution has ``logic_lines`` lines of logic:
    :data:`EXERCISE_BASE_MIN` + one minute per :data:`LOGIC_LINES_PER_MINUTE` lines."""
    return EXERCISE_BASE_MIN + logic_lines / LOGIC_LINES_PER_MINUTE


def _statement_lines(node) -> set:
    """The line numbers a learner writes in a function's or class's body: the docstring and,
    in a class, the methods' ``def`` lines (the stub gives both) left out."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]                  # the docstring is the exercise's, not the learner's
    numbers = set()
    for stmt in body:
        if isinstance(node, ast.ClassDef) and isinstance(stmt, (ast.FunctionDef,
                                                                 ast.AsyncFunctionDef)):
            numbers |= _statement_lines(stmt)
        else:
            numbers |= set(range(stmt.lineno, stmt.end_lineno + 1))
    return numbers


def _body_lines(source: str, fn) -> int:
    lines = source.splitlines()
    return sum(1 for n in _statement_lines(fn) if lines[n - 1].strip()
               and not lines[n - 1].strip().startswith("#"))


def solution_logic_lines(lab: str) -> Dict[str, int]:
    """``{learner's function or class: logic lines of its solution}`` for lab ``lab`` ("11"),
    from its file in ``labs/solutions/`` (empty when the lab has none). A class's lines are
    those of its methods' bodies and its class-level statements."""
    if lab not in solutions.SOLUTIONS:
        return {}
    source = solutions.solution_source(lab)
    fns = {n.name: n for n in ast.walk(ast.parse(source))
           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return {learner: _body_lines(source, fns[sol])
            for learner, sol in solutions.SOLUTIONS[lab].names.items() if sol in fns}


def _graded(source: str, lines: Dict[str, int]) -> List[tuple]:
    """``[(names, minutes)]`` of each ``grade(`` call in a cell: the functions it grades (its
    first argument, one name or a tuple of them) and the minutes by their solutions."""
    out = []
    for m in _GRADED.finditer(source):
        names = re.findall(r"[A-Za-z_]\w*", m.group(1))
        known = [lines[n] for n in names if n in lines]
        out.append((names, exercise_minutes(sum(known)) if known else MINUTES_PER_EXERCISE))
    return out


def _graded_minutes(source: str, lines: Dict[str, int]) -> List[float]:
    return [minutes for _, minutes in _graded(source, lines)]


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
    builds: List[Build] = []
    build: Optional[Build] = None      # the marked build whose section this cell is in
    in_core = True
    for cell in nb.cells:
        if cell.cell_type == "markdown" and stopwatch.GOING_FURTHER.search(cell.source):
            in_core = False
        if cell.cell_type == "markdown" and _ENDS_BUILD.search(cell.source):
            marked = BUILD_HEADING.findall(cell.source)
            build = Build(marked[-1]) if marked and in_core else None
            if build is not None:
                builds.append(build)
        if not in_core:
            extra += _cell_parts(cell, lines)
            continue
        parts = _cell_parts(cell, lines)
        if build is not None:       # a build's contract and stub are read while writing it
            build.minutes += parts.reading_minutes
        else:
            core += parts
        if cell.cell_type == "code" and "parameters" not in cell.metadata.get("tags", []):
            for names, minutes in _graded(cell.source, lines):
                if build is None:
                    builds.append(Build(", ".join(names), marked=False))
                    target = builds[-1]
                else:
                    target = build
                target.exercises += 1
                target.minutes += minutes
    return LabSize(path.stem, core, extra, (compute or {}).get(path.stem), builds)


def section_minutes(path: pathlib.Path) -> List[tuple]:
    """``[(heading, minutes)]`` for each ``#``/``##`` section of one notebook and each build
    (``### Build: <piece>``, named ``Build: <piece>``), compute left out: where a lab's
    reading, figures and exercises go, to see which depth could move to "Going further". What
    follows a build under a later ``###`` heading is its ``##`` section's again, named
    ``<heading> (cont.)``."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    lines = solution_logic_lines(path.name[:2])
    sections = [["(before the title)", 0.0]]
    outer, in_build = sections[0][0], False
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            heading = _HEADING.search(cell.source)
            build = BUILD_HEADING.search(cell.source)
            if heading:
                outer, in_build = heading.group(2).strip(), False
                sections.append([outer, 0.0])
            if build:
                in_build = True
                sections.append([f"Build: {build.group(1)}", 0.0])
            elif in_build and _ENDS_BUILD.search(cell.source):
                in_build = False
                sections.append([f"{outer} (cont.)", 0.0])
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
    core's parts and estimate (reading and running), its builds beside it (how many, and
    their writing time together), then (where a stopwatch file holds any) the minutes measured
    while working through the core, and the optional depth last."""
    measured = measured or {}
    shown = f" {measured_title:>11}" if measured else ""
    width = max([23] + [len(s.name) for s in sizes])
    lines = [f"{'lab':<{width}} {'words':>5} {'output':>6} {'figs':>4} {'checks':>6} "
             f"{'compute':>7} {'core, est.':>10} {'builds':>9}{shown} {'further':>7}"]
    for s in sizes:
        compute = "n/a" if s.compute_s is None else f"{s.compute_s / 60:.1f} min"
        extra = f"+{s.extra_minutes:.0f} min" if s.extra_minutes else "-"
        work = f"{len(s.builds)}: {s.build_minutes:.0f} min" if s.builds else "-"
        mine = ""
        if measured:
            minutes, learners = measured.get(s.name, (None, 0))
            mine = f" {'-':>11}" if minutes is None else \
                f" {f'{minutes:.0f} min' + (f' ({learners})' if learners > 1 else ''):>11}"
        lines.append(f"{s.name:<{width}} {s.core.words:>5,} {s.core.output_words:>6,} "
                     f"{s.core.figures:>4} {s.core.questions:>6} {compute:>7} "
                     f"{s.core_minutes:>6.0f} min {work:>9}{mine} {extra:>7}")
    return "\n".join(lines)


def format_builds(sizes: Sequence[LabSize]) -> str:
    """Each lab's builds with their writing time, one lab a paragraph (lines of at most 100
    characters); a build no ``### Build:`` heading marks is named by what it grades, with
    ``(unmarked)``."""
    paragraphs = []
    for s in sizes:
        if not s.builds:
            continue
        said = "; ".join(f"{b.name}{'' if b.marked else ' (unmarked)'}\xa0{b.minutes:.0f}\xa0min"
                         for b in s.builds)
        paragraphs.append(textwrap.fill(f"{s.name}: {said}", 100, subsequent_indent="    ",
                                        break_on_hyphens=False).replace("\xa0", " "))
    return "\n".join(paragraphs)


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
    print(f"\ncore, est. = reading and running: (words + output words read) / "
          f"{WORDS_PER_MINUTE} per minute\n"
          f"  + {MINUTES_PER_FIGURE} min per figure\n"
          f"  + {MINUTES_PER_QUESTION} min per question checked (checks)\n"
          f"  + the compute, measured when the lab was last re-executed\n    ({machine}).\n"
          f"builds = the write-the-code exercises of the core, your writing time (not in the "
          f"core):\n  per exercise {EXERCISE_BASE_MIN} min + 1 min per "
          f"{LOGIC_LINES_PER_MINUTE} logic lines of its solution.")
    listed = format_builds(sizes)
    if listed:
        print(f"\nThe builds, lab by lab (writing time, est.):\n{listed}")
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
