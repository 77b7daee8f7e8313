"""Stored notebook outputs print floats only to digits that survive another machine.

nbval compares each stored output with a fresh run. A float32 loss printed to 7 digits records
one machine's rounding: lab 04's DP = 2 loss printed 6.113932 here and 6.113933 on another
machine of the same kind, and its relative difference 0e+00 against 8e-08. So a
bare float with more than 6 significant digits may appear only in a cell whose output is not
compared (tagged ``nbval-ignore-output`` / ``nbval-skip``, or with an ``# NBVAL_IGNORE_OUTPUT``
/ ``# NBVAL_SKIP`` comment), after the sanitize file has had its say, as nbval applies it.
"""
from __future__ import annotations

import pathlib
import re
from typing import Iterator, List, Tuple

import nbformat
import pytest

from mpu_lab.labkit.data_parallel import lessons as dp_lessons
from mpu_lab.labkit.train_gpt import runs as gpt_runs

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = [ROOT / "Start_Here.ipynb", *sorted((ROOT / "labs").glob("*.ipynb"))]
MAX_SIGNIFICANT = 6

# A number with a decimal point, optionally an exponent; not part of a longer token (a
# version such as 2.13.0, an address, a name such as fp32 or 1e-5 inside a word).
FLOAT = re.compile(r"(?<![\w.])[-+]?(?P<mantissa>\d+\.\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w.])")
UNCOMPARED_TAGS = {"nbval-ignore-output", "nbval-skip"}
UNCOMPARED_COMMENTS = {"NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP"}
COMPARED_MIME = ("text/plain", "text/html")     # what nbval compares besides streams


def significant_digits(number: str) -> int:
    """Digits of the mantissa after leading zeros: ``6.113932`` -> 7, ``0.00120`` -> 3."""
    match = FLOAT.fullmatch(number)
    if match is None:
        raise ValueError(f"{number!r} is not a float with a decimal point")
    return len(match.group("mantissa").replace(".", "").lstrip("0"))


def long_floats(text: str) -> List[str]:
    """Every bare float in ``text`` with more than MAX_SIGNIFICANT significant digits."""
    return [m.group(0) for m in FLOAT.finditer(text)
            if significant_digits(m.group(0).lstrip("+-")) > MAX_SIGNIFICANT]


def sanitizers() -> List[Tuple[re.Pattern, str]]:
    """The regex/replace pairs of tests/nbval_sanitize.cfg, in order."""
    lines = (ROOT / "tests" / "nbval_sanitize.cfg").read_text().splitlines()
    return [(re.compile(line[len("regex: "):]), nxt[len("replace: "):])
            for line, nxt in zip(lines, lines[1:])
            if line.startswith("regex: ") and nxt.startswith("replace: ")]


def is_compared(cell) -> bool:
    """Whether nbval compares this code cell's output (no skip/ignore tag or comment)."""
    if UNCOMPARED_TAGS & set(cell.get("metadata", {}).get("tags", [])):
        return False
    comments = {line.strip()[1:].strip() for line in cell.source.splitlines()
                if line.strip().startswith("#")}
    return not (UNCOMPARED_COMMENTS & comments)


def compared_text(cell) -> Iterator[str]:
    """The text nbval compares in a cell's stored outputs (stderr is left out: see
    mpu_lab.labkit.notebooks.plugin)."""
    for out in cell.get("outputs", []):
        if out.output_type == "stream" and out.name == "stdout":
            yield out.text
        elif out.output_type in ("execute_result", "display_data"):
            for mime in COMPARED_MIME:
                if mime in out.data:
                    yield out.data[mime]


@pytest.mark.parametrize("number, digits", [("6.113932", 7), ("6.1139", 5), ("0.00120", 3),
                                            ("129.25", 5), ("8.0e-08", 2),
                                            ("1.234567e+00", 7), (".5", 1), ("70144.0", 6)])
def test_significant_digits_counted_by_hand(number, digits):
    assert significant_digits(number) == digits


def test_long_floats_skip_versions_names_and_integers():
    text = "torch 2.13.0 at fdfdc0c, fp32, 1e-5, 1087 tests, loss 6.113932 (+0.6916)"
    assert long_floats(text) == ["6.113932"]
    assert long_floats("sum -12.3456789 and 0.000001234") == ["-12.3456789"]


def test_significant_digits_rejects_what_is_not_a_float():
    with pytest.raises(ValueError, match="'1087' is not a float"):
        significant_digits("1087")


def test_compared_cells_are_told_apart_by_tag_and_comment():
    plain = nbformat.v4.new_code_cell("print(1.0)")
    tagged = nbformat.v4.new_code_cell("print(1.0)", metadata={"tags": ["nbval-ignore-output"]})
    commented = nbformat.v4.new_code_cell("# NBVAL_IGNORE_OUTPUT\nprint(1.0)")
    skipped = nbformat.v4.new_code_cell("x = 1  #  NBVAL_SKIP")   # not a comment line
    assert [is_compared(c) for c in (plain, tagged, commented, skipped)] == [True, False, False,
                                                                             True]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_compared_outputs_print_no_float_past_six_significant_digits(path):
    notebook = nbformat.read(path, as_version=4)
    rules = sanitizers()
    found = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code" or not is_compared(cell):
            continue
        for text in compared_text(cell):
            for pattern, replacement in rules:
                text = pattern.sub(replacement, text)
            for line in text.splitlines():
                if long_floats(line):
                    found.append(f"cell {index}: {long_floats(line)} in {line.strip()!r}")
    assert not found, (
        f"{path.name} stores floats with more than {MAX_SIGNIFICANT} significant digits in "
        f"cells nbval compares; print fewer digits (losses to 4-5 significant digits, equality "
        f"as 'equal within <bound>') or tag the cell nbval-ignore-output:\n" + "\n".join(found))


def _run(label: str, losses: List[float]) -> "gpt_runs.TrainRun":
    return gpt_runs.TrainRun(label=label, iterations=list(range(1, len(losses) + 1)),
                             losses=losses, results=[], elapsed_s=0.0, nproc=1)


def test_same_batch_table_is_identical_across_a_few_ulps(capsys):
    """Lab 04's two machines: 6.113932 against 6.113933 (1.6e-7 relative) print the same."""
    one = [6.255487, 6.174635, 6.113932]
    other = [6.255487, 6.174635, 6.113933]
    dp_lessons.print_same_batch([_run("DP=2", one)], _run("DP=1", one))
    here = capsys.readouterr().out
    dp_lessons.print_same_batch([_run("DP=2", other)], _run("DP=1", one))
    there = capsys.readouterr().out
    assert here == there
    assert "        3       6.1139      6.1139   yes" in here.splitlines()
    assert here.splitlines()[-1] == \
        "DP=2 vs DP=1: equal within 1e-5 at every step (relative; fp32 rounding)"
    assert not long_floats(here)


def test_same_batch_table_names_a_difference_past_the_bound(capsys):
    dp_lessons.print_same_batch([_run("DP=2", [6.0, 6.0003])], _run("DP=1", [6.0, 6.0]))
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].endswith("   no")
    assert lines[-1] == ("DP=2 vs DP=1: NOT equal within 1e-5: largest relative "
                         "difference 5.0e-05")
