"""How long each lab takes: its core (everything before the first "Going further" heading) and
its optional depth, counted from the notebook, and the compute its cells took when the lab was
last re-executed here (``regenerate`` records it in ``labs/compute_times.json`` with the
machine).

A lab's time is an estimate built from measured parts, and says so: the prose and code a
learner reads (words, at :data:`WORDS_PER_MINUTE`), the exercises they work
(:data:`MINUTES_PER_EXERCISE` for a write-the-code exercise graded on a live world,
:data:`MINUTES_PER_QUESTION` for a question checked by ``check_*``), and the cells' compute as
measured. Start_Here prints the table; the core of each lab is meant to stay within
:data:`CORE_BUDGET_MIN`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import re
from typing import Dict, List, Optional, Sequence

from mpu_lab.labkit import REPO_ROOT
from mpu_lab.labkit.notebooks import stopwatch
from mpu_lab.labkit.notebooks.selection import lab_paths

WORDS_PER_MINUTE = 120        # technical prose with formulas and code, read to be understood
MINUTES_PER_EXERCISE = 10     # write a function, run the grader, fix it once
MINUTES_PER_QUESTION = 2      # a predicted number or shape, checked
CORE_BUDGET_MIN = 45          # one sitting
TIMES_FILE = REPO_ROOT / "labs" / "compute_times.json"
_WORD = re.compile(r"[A-Za-z0-9_$\\]+")
# what a reader skips in markdown: a link's target (its text is read), a bare URL, an HTML tag
_UNREAD = re.compile(r"(?<=\])\([^)\s]*\)|https?://\S+|</?[A-Za-z][^>\n]*>")
_HEADING = re.compile(r"^(#{1,2})\s+(.+)$", re.M)


@dataclasses.dataclass
class LabSize:
    """One lab's parts: words, exercises and questions in its core and in its optional depth."""

    name: str
    core_words: int
    extra_words: int
    exercises: int
    questions: int
    compute_s: Optional[float]
    extra_exercises: int = 0
    extra_questions: int = 0

    @property
    def core_minutes(self) -> float:
        """Reading, exercises, questions and the measured compute of the whole notebook."""
        return minutes(self.core_words, self.exercises, self.questions) + (self.compute_s or 0.0) / 60

    @property
    def extra_minutes(self) -> float:
        """Reading, exercises and questions of the "Going further" sections."""
        return minutes(self.extra_words, self.extra_exercises, self.extra_questions)


def minutes(words: int, exercises: int, questions: int) -> float:
    """The estimate's minutes for reading ``words``, working ``exercises`` and ``questions``."""
    return (words / WORDS_PER_MINUTE + MINUTES_PER_EXERCISE * exercises
            + MINUTES_PER_QUESTION * questions)


def _words(source: str, markdown: bool = False) -> int:
    if markdown:
        source = _UNREAD.sub(" ", source)
    return len(_WORD.findall(source))


def _cell_parts(cell) -> tuple:
    """(words, write-the-code exercises, questions) of one cell; a parameters cell counts none."""
    if cell.cell_type == "code" and "parameters" in cell.metadata.get("tags", []):
        return 0, 0, 0
    words = _words(cell.source, markdown=cell.cell_type == "markdown")
    if cell.cell_type != "code":
        return words, 0, 0
    return (words, len(re.findall(r"\bgrade\(", cell.source)),
            len(re.findall(r"\bcheck_\w+\(", cell.source)))


def lab_size(path: pathlib.Path, compute: Optional[Dict[str, float]] = None) -> LabSize:
    """Count one notebook: words (markdown as read: link targets, URLs and HTML tags left out),
    ``grade(`` calls (write-the-code exercises) and ``check_`` calls (questions), before and
    after the first "Going further" heading."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    core = extra = exercises = questions = extra_exercises = extra_questions = 0
    in_core = True
    for cell in nb.cells:
        if cell.cell_type == "markdown" and stopwatch.GOING_FURTHER.search(cell.source):
            in_core = False
        words, graded, checked = _cell_parts(cell)
        if in_core:
            core += words
            exercises += graded
            questions += checked
        else:
            extra += words
            extra_exercises += graded
            extra_questions += checked
    seconds = (compute or {}).get(path.stem)
    return LabSize(path.stem, core, extra, exercises, questions, seconds, extra_exercises,
                   extra_questions)


def section_minutes(path: pathlib.Path) -> List[tuple]:
    """``[(heading, minutes)]`` for each ``#``/``##`` section of one notebook, compute left out:
    where a lab's reading and exercises go, to see which depth could move to "Going further"."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    sections = [["(before the title)", 0.0]]
    for cell in nb.cells:
        heading = _HEADING.search(cell.source) if cell.cell_type == "markdown" else None
        if heading:
            sections.append([heading.group(2).strip(), 0.0])
        sections[-1][1] += minutes(*_cell_parts(cell))
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
    """The table Start_Here prints: one row per lab, the core's estimate, then (where a
    stopwatch file holds any) the minutes measured while working through the core, and the
    optional depth last."""
    measured = measured or {}
    shown = f" {measured_title:>12}" if measured else ""
    lines = [f"{'lab':<26} {'core words':>10} {'exercises':>9} {'questions':>9} "
             f"{'compute':>8} {'core, est.':>10}{shown} {'going further':>13}"]
    for s in sizes:
        compute = "n/a" if s.compute_s is None else f"{s.compute_s / 60:.1f} min"
        extra = f"+{s.extra_minutes:.0f} min" if s.extra_words else "-"
        mine = ""
        if measured:
            minutes, learners = measured.get(s.name, (None, 0))
            mine = f" {'-':>12}" if minutes is None else \
                f" {f'{minutes:.0f} min' + (f' ({learners})' if learners > 1 else ''):>12}"
        lines.append(f"{s.name:<26} {s.core_words:>10,} {s.exercises:>9} {s.questions:>9} "
                     f"{compute:>8} {s.core_minutes:>6.0f} min{mine} {extra:>13}")
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
    print(f"\ncore, est. = words / {WORDS_PER_MINUTE} per minute + {MINUTES_PER_EXERCISE} min per "
          f"write-the-code exercise + {MINUTES_PER_QUESTION} min per question + the compute, "
          f"measured when the lab was last re-executed ({machine}).")
    if measured:
        whose = ("your own sittings" if not times else
                 f"the median over {len(files)} learners' files (how many worked through it)")
        print(f"{title} = the active minutes from a lab's first cell to the last cell of its core, "
              f"pauses over {stopwatch.BREAK_S // 60} min left out: {whose}.")
    over = [s.name for s in sizes if s.core_minutes > CORE_BUDGET_MIN]
    print(f"cores over {CORE_BUDGET_MIN} min: {', '.join(over) if over else 'none'}; "
          f"total of the cores {sum(s.core_minutes for s in sizes) / 60:.1f} h")
