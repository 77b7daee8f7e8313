"""Answers in sight before the learner commits: a question's answer that a learner can read in
a stored notebook before running the cell where they commit to their own.

A lab asks a question ("**Predict**: how many all-reduces ...?"), the learner writes an answer
in a cell (``answer = None`` then ``check_...(answer, ...)``; ``grade(...)`` for a
write-the-code exercise) and only then sees the result. That only teaches if nothing above the
question already says it, and nothing below it (stored outputs, prose) says it before the
learner has run the answer cell. The graders know each answer, so they declare it here
(:func:`declare_answers`: lab, question id, answer values, and the text that marks the
learner's answer cell), and :func:`find_leaks` searches a notebook for them:

* **above the answer cell**: markdown (prose, and figure captions written in it), the comments
  and string literals of code cells (where titles and labels of figures are written: a PNG
  cannot be searched, the code that draws it can; numbers passed as arguments are parameters,
  not read), and stored text outputs (``text/plain``, streams, ``text/markdown``). The question
  itself is left out: the answer cell's source (its example values and the check's arguments
  state the question), the paragraphs of the markdown cell that ask it (those with a ``?`` or
  "Predict"; the rest of that cell is prose above like any other), the answer cell's own
  "No answer yet: ..." line (it restates what to answer), and numbering that is not content
  (``## 9. Exercises``, ``**1.**``, a numbered list's ``2.``);
* **below the answer cell**, to the end of the notebook: stored outputs, prose and the comments
  and string literals of code cells. A learner can scroll before they commit, so a measurement
  that prints the answer (lab 11's bubble share in the next cell's stored table, lab 12's idle
  slots a section further on) is a ``reveal`` cell, stored empty, and the prose after it
  explains without restating the answer (a ``reveal`` cell's own output can);
* **reveal cells stored with outputs**: a code cell tagged ``reveal``, or one that calls
  ``reveal(...)``, must be stored empty (lab 17's fault named in stored reveal outputs).

How an answer is matched (:func:`hits`), by its type:

* an integer: as a whole number (``(?<![\\w.])`` ... no following letter, digit or decimal
  part), thousands separators allowed (``50,304``), ``8.0`` counts as 8;
* a non-integer float: any printed number that is the answer rounded to the digits printed,
  with at least two significant digits (``0.11`` or ``11 %`` or ``11.1%`` for 0.1111; ``0.1``
  does not count); a :class:`fractions.Fraction` also as ``3/11``;
* a string of three characters or more: the words, case-insensitive, spaces flexible; a
  shorter one (a letter, ``"tp"``) only in quotes;
* a tuple or list (nested ones flattened): a bracketed group holding exactly those elements in
  that order, ``(1, 0)``, ``[4, 8]``, ``torch.Size([4, 8])``, ``[[1.0, 2.0]]``, ``tensor([3.,
  3.])``; an integer pair or triple also as ``4 x 8``; three or more integers also without
  brackets (``2, 6, 10, 14``).

A whole number below 100 is a *weak* match (it appears in prose for many reasons): it is only
searched in the answer's own section (from the last ``#``/``##`` heading above the answer cell
to the next one below it) and its leaks carry ``weak=True``, to be read by eye. Every other match is searched from the
notebook's first cell. A grader whose answer is a small number should also declare the phrase
that would give it away ("4 ranks").
"""
from __future__ import annotations

import dataclasses
import fractions
import pathlib
import re
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

REVEAL_TAG = "reveal"
_REVEAL_CALL = re.compile(r"\breveal\(")
_HEADING = re.compile(r"^#{1,2}\s", re.M)
# a number in text: no letter, digit or point before it, and after it no decimal part and no
# letter other than a unit ("1.78x", "3.6 GB", "12 ms", "8x")
_UNIT = r"(?:x|×|ms|us|s|[KMGT]i?B|B|GB/s)\b"
_NUMBER = re.compile(rf"(?<![\w.])(-?(?:\d{{1,3}}(?:,\d{{3}})+|\d+))(?:\.(\d+))?"
                     rf"(?!(?!{_UNIT})\w|\.\d)(\s*%)?")
_CODE_TEXT = re.compile(r"#[^\n]*|\"[^\"\n]*\"|'[^'\n]*'")
_QUESTION = re.compile(r"\?|\bpredict\b", re.I)
# numbering that is not content: "## 9. Exercises", "**1.**", an ordered list's "2. "
_NUMBERING = re.compile(r"^#+\s*(?:\d+\.)+\s|^\s*\d+[.)]\s|\*\*\d+\.\*\*", re.M)
# the answer cell's own stored output before an answer: it restates the question
_UNANSWERED = re.compile(r"^No answer yet:.*$", re.M)
WEAK_BELOW = 100


@dataclasses.dataclass(frozen=True)
class Answer:
    """One graded question's answer(s): ``lab`` ("07"), ``question`` (an id the report quotes),
    ``answers`` (the values, and phrases, that give it away), ``commit``: text found in the
    source of the learner's answer cell (``check_mlp_all_reduces(``), and ``occurrence``: which
    of the cells holding that text (0 = the first) when several do."""

    lab: str
    question: str
    answers: Tuple[Any, ...]
    commit: str
    occurrence: int = 0


@dataclasses.dataclass(frozen=True)
class Leak:
    """Where an answer shows before the learner commits: the notebook cell, what kind of text
    (``where``), the text matched, and ``weak`` (a small number, to read by eye)."""

    lab: str
    question: str
    cell: int
    where: str
    text: str
    weak: bool = False

    def __str__(self) -> str:
        weak = " (weak: a small number, read it by eye)" if self.weak else ""
        return (f"lab {self.lab} cell {self.cell}: {self.question!r} answered in the "
                f"{self.where}: {self.text!r}{weak}")


_REGISTRY: Dict[Tuple[str, str], Answer] = {}


def declare_answers(entries: Iterable[Sequence]) -> Tuple[Answer, ...]:
    """Register graded answers: each entry ``(lab, question, answers, commit[, occurrence])``.
    ``answers`` is a ``list`` of the values and phrases that give the answer away, or one value
    that is not a list (a tuple is one value: ``(1, 1)``; a list-valued answer goes in a list
    of its own: ``[[2, 6, 10, 14], "ranks 2, 6, 10 and 14"]``). A grader module declares its
    answers when it is imported, so a test imports the graders, then checks each notebook
    with :func:`notebook_leaks`. A later declaration of the same (lab, question) replaces the
    earlier one. Returns the declared :class:`Answer` s.

        >>> declare_answers([("99", "mlp all-reduces", [(1, 1), "one all-reduce each way"],
        ...                   "check_mlp_all_reduces(")])[0].answers
        ((1, 1), 'one all-reduce each way')
    """
    made = []
    for entry in entries:
        if not 4 <= len(entry) <= 5:
            raise ValueError(f"an answer is (lab, question, answers, commit[, occurrence]), "
                             f"got {entry!r}")
        lab, question, answers, commit = entry[:4]
        values = tuple(answers) if isinstance(answers, list) else (answers,)
        if not str(commit).strip():
            raise ValueError(f"lab {lab} question {question!r}: commit must be text found in "
                             f"the learner's answer cell, got {commit!r}")
        answer = Answer(str(lab), str(question), values, str(commit),
                        int(entry[4]) if len(entry) == 5 else 0)
        _REGISTRY[(answer.lab, answer.question)] = answer
        made.append(answer)
    return tuple(made)


def declared_answers(lab: Optional[str] = None) -> List[Answer]:
    """The declared answers, all or one lab's, in declaration order."""
    return [a for a in _REGISTRY.values() if lab is None or a.lab == lab]


# --------------------------------------------------------------------------- matching
def _flat(value: Any) -> List[Any]:
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in _flat(item)]
    return [value]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) or (
        isinstance(value, float) and value.is_integer())


def _number(token: re.Match) -> Tuple[float, int, int]:
    """(value, decimals, significant digits) of a number in text; a percentage as a share."""
    whole, frac, percent = token.group(1).replace(",", ""), token.group(2) or "", token.group(3)
    value = float(f"{whole}.{frac or 0}")
    decimals = len(frac)
    digits = (whole.lstrip("-") + frac).lstrip("0")
    if percent:
        value, decimals = value / 100, decimals + 2
    return value, decimals, len(digits)


def _number_equals(token: re.Match, value: Any, need_digits: int = 2) -> bool:
    got, decimals, digits = _number(token)
    if token.group(3) and _is_int(value) and float(value) > 1:
        return False                       # "8 %" is not the answer 8
    if _is_int(value):
        return not token.group(3) and got == float(value) and (
            not token.group(2) or set(token.group(2)) == {"0"})
    return digits >= need_digits and abs(got - float(value)) <= 0.5 * 10 ** -decimals * (1 + 1e-9)


def _token_equals(token: str, value: Any) -> bool:
    token = token.strip()
    if isinstance(value, str):
        return token.strip("'\"").strip().lower() == value.lower()
    m = _NUMBER.fullmatch(token.rstrip("."))
    return m is not None and _number_equals(m, value, need_digits=1)


def _bracket_groups(text: str) -> List[Tuple[int, int]]:
    """(start, end) of every balanced ``(...)`` / ``[...]`` group in ``text``."""
    spans, stack = [], []
    for i, ch in enumerate(text):
        if ch in "([":
            stack.append(i)
        elif ch in ")]" and stack:
            spans.append((stack.pop(), i + 1))
    return spans


def _seq_hits(text: str, values: List[Any]) -> List[str]:
    found = []
    for start, end in _bracket_groups(text):
        # the group's items, brackets and callables (torch.Size(, tensor() left out
        inner = re.sub(r"\b[A-Za-z_][\w.]*\s*(?=[(\[])|[()\[\]]", "", text[start:end])
        tokens = [t for t in inner.split(",") if t.strip()]
        if len(tokens) == len(values) and all(_token_equals(t, v) for t, v in zip(tokens, values)):
            found.append(text[start:end])
    if all(_is_int(v) for v in values):
        ints = [str(int(v)) for v in values]
        forms = []
        if 2 <= len(ints) <= 3:
            forms.append(r"\s*[x×]\s*".join(ints))
        if len(ints) >= 3:
            forms.append(r"\s*,\s*".join(ints))
        for form in forms:
            bare = rf"(?<![\w.,(\[]){form}(?![\w]|\.\d|,\s*\d)"
            found += [m.group(0) for m in re.finditer(bare, text)]
    return found


def hits(text: str, value: Any) -> List[Tuple[str, bool]]:
    """Where ``value`` (one answer) shows in ``text``: ``[(matched text, weak)]`` by the rules
    of the module docstring."""
    if isinstance(value, (list, tuple)):
        values = _flat(value)
        if len(values) == 1:
            return hits(text, values[0])
        return [(t, False) for t in _seq_hits(text, values)]
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, str):
        words = value.strip()
        if len(words) < 3:
            pattern = rf"(['\"]){re.escape(words)}\1"
        else:
            pattern = r"\s+".join(re.escape(w) for w in words.split())
            pattern = (r"\b" if words[0].isalnum() else "") + pattern + (
                r"\b" if words[-1].isalnum() else "")
        return [(m.group(0), False) for m in re.finditer(pattern, text, re.I)]
    found = []
    if isinstance(value, fractions.Fraction):
        found += [(m.group(0), False) for m in re.finditer(
            rf"(?<![\w.]){value.numerator}\s*/\s*{value.denominator}(?![\w]|\.\d)", text)]
    weak = _is_int(value) and abs(float(value)) < WEAK_BELOW
    found += [(m.group(0).strip(), weak) for m in _NUMBER.finditer(text)
              if _number_equals(m, value)]
    return found


# --------------------------------------------------------------------------- the notebook
def output_text(cell) -> str:
    """What a learner reads in a code cell's stored outputs: text/plain, text/markdown and the
    streams (images cannot be searched, the code that draws them is; a figure's text/plain is
    a stand-in nobody sees)."""
    parts = []
    for out in cell.get("outputs", []):
        text = out.get("text", "")
        data = out.get("data", {})
        plain = "" if "image/png" in data else data.get("text/plain", "")
        for part in (text, plain, data.get("text/markdown", "")):
            parts.append("".join(part) if isinstance(part, list) else part)
    return "\n".join(p for p in parts if p)


def _is_reveal(cell) -> bool:
    return cell.cell_type == "code" and (
        REVEAL_TAG in cell.get("metadata", {}).get("tags", [])
        or bool(_REVEAL_CALL.search(cell.source)))


def commit_cell(nb, answer: Answer) -> int:
    """The index of ``answer``'s answer cell: its ``occurrence``-th code cell holding
    ``answer.commit``."""
    found = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and answer.commit in c.source]
    if len(found) <= answer.occurrence:
        raise ValueError(f"lab {answer.lab} question {answer.question!r}: {len(found)} code "
                         f"cell(s) hold {answer.commit!r}, need occurrence {answer.occurrence}")
    return found[answer.occurrence]


def _section_start(nb, commit: int) -> Tuple[int, int]:
    """(cell, character offset) where the answer cell's section starts: its last ``#``/``##``
    heading above the answer cell."""
    for i in range(commit - 1, -1, -1):
        cell = nb.cells[i]
        if cell.cell_type == "markdown":
            heads = list(_HEADING.finditer(cell.source))
            if heads:
                return i, heads[-1].start()
    return 0, 0


def _question_cell(nb, commit: int) -> Optional[int]:
    for i in range(commit - 1, -1, -1):
        if nb.cells[i].cell_type == "markdown":
            return i if _QUESTION.search(nb.cells[i].source) else None
    return None


def _texts_above(nb, commit: int) -> List[Tuple[int, str, str, bool]]:
    """``(cell, where, text, in the answer's section)`` for everything above the answer cell,
    and the answer cell's own stored output."""
    first, offset = _section_start(nb, commit)
    asked = _question_cell(nb, commit)
    out = []
    for i in range(commit + 1):
        cell = nb.cells[i]
        if cell.cell_type == "markdown":
            text = cell.source
            if i == first:        # above the section's heading is not the answer's section
                out.append((i, "prose above", _NUMBERING.sub(" ", text[:offset]), False))
                text = text[offset:]
            if i == asked:        # the paragraphs that ask the question are not its answer
                text = "\n\n".join(p for p in re.split(r"\n\s*\n", text) if not _QUESTION.search(p))
            out.append((i, "prose above", _NUMBERING.sub(" ", text), i >= first))
        elif cell.cell_type == "code" and i < commit:
            code = "\n".join(m.group(0) for m in _CODE_TEXT.finditer(cell.source))
            out.append((i, "code above (comments, titles, labels)", code, i >= first))
            out.append((i, "output above", output_text(cell), i >= first))
        elif cell.cell_type == "code":
            out.append((i, "answer cell's stored output",
                        _UNANSWERED.sub("", output_text(cell)), True))
    return out


def _texts_below(nb, commit: int) -> List[Tuple[int, str, str, bool]]:
    """``(cell, where, text, in the answer's section)`` for everything below the answer cell,
    to the end of the notebook: the section ends at the next ``#``/``##`` heading."""
    out, in_section = [], True
    for i in range(commit + 1, len(nb.cells)):
        cell = nb.cells[i]
        if cell.cell_type == "markdown":
            text = cell.source
            head = _HEADING.search(text) if in_section else None
            if head:
                out.append((i, "prose below", _NUMBERING.sub(" ", text[:head.start()]), True))
                text, in_section = text[head.start():], False
            out.append((i, "prose below", _NUMBERING.sub(" ", text), in_section))
        elif cell.cell_type == "code":
            code = "\n".join(m.group(0) for m in _CODE_TEXT.finditer(cell.source))
            out.append((i, "code below (comments, titles, labels)", code, in_section))
            out.append((i, "output below, stored", output_text(cell), in_section))
    return out


def answer_leaks(nb, answers: Iterable[Answer], lab: str = "") -> List[Leak]:
    """Each place where one of ``answers`` shows before its learner commits (see the module
    docstring), in cell order per question."""
    leaks = []
    for answer in answers:
        commit = commit_cell(nb, answer)
        texts = _texts_above(nb, commit) + _texts_below(nb, commit)
        for cell, where, text, in_section in texts:      # one leak per cell and kind of text
            found = [(matched, weak) for value in answer.answers
                     for matched, weak in hits(text, value) if in_section or not weak]
            if found:
                matched, weak = min(found, key=lambda f: f[1])     # a strong match first
                leaks.append(Leak(lab or answer.lab, answer.question, cell, where, matched, weak))
    return leaks


def reveal_leaks(nb, lab: str = "") -> List[Leak]:
    """Reveal cells (tagged ``reveal``, or calling ``reveal(...)``) stored with outputs."""
    return [Leak(lab, "reveal", i, "reveal cell stored with outputs",
                 output_text(cell)[:80] or "(an image)")
            for i, cell in enumerate(nb.cells) if _is_reveal(cell) and cell.get("outputs")]


def find_leaks(nb, answers: Iterable[Answer], lab: str = "") -> List[Leak]:
    """:func:`answer_leaks` and :func:`reveal_leaks` of one notebook (an nbformat node)."""
    return answer_leaks(nb, answers, lab) + reveal_leaks(nb, lab)


def notebook_leaks(path: pathlib.Path, answers: Optional[Iterable[Answer]] = None) -> List[Leak]:
    """The leaks of a notebook file, for the answers declared for its lab (its first two
    characters, ``07_row_parallel.ipynb`` -> ``"07"``) unless ``answers`` are given."""
    import nbformat

    path = pathlib.Path(path)
    lab = path.name[:2]
    nb = nbformat.read(str(path), as_version=4)
    return find_leaks(nb, declared_answers(lab) if answers is None else answers, lab)
