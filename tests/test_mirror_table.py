"""docs/ARCHITECTURE.md's table "The mirror, file by file", held to the tree and to Megatron-core.

The table's format, as this test reads it:

* it sits between the lines ``<!-- mirror-table: begin -->`` and ``<!-- mirror-table: end -->``;
* it is a markdown table of four columns, a header row and a ``|---|`` row first, then one row
  per file: ``| file | source | mirrors | notes |``;
* **file**: one backticked path relative to ``mpu_lab/``, e.g. ```core/tensor_parallel/layers.py```;
* **source**: ``megatron-core``, ``TransformerEngine`` or ``torch.distributed``;
* **mirrors**: the counterpart, as backticked paths, each optionally followed by the names it
  holds in parentheses: ```megatron/core/utils.py` (`get_batch_on_this_cp_rank`)``; entries
  are separated by ``;``. The first entry starts with ``megatron/core/`` for a megatron-core row,
  ``transformer_engine/`` for a TransformerEngine row, and is ```torch.distributed``` for a
  torch.distributed row;
* **notes**: free text. A backticked ``megatron/core/…`` path in it, with its parenthesised
  names, is checked like one in the mirrors column. A torch.distributed row's notes name the
  Megatron-core file that holds the equivalent logic (Megatron calls the collectives in place).

What is checked:

(a) every ``.py`` file under ``mpu_lab/core/`` has exactly one row, and every row's file exists;
(b) where megatron-core is installed (skipped otherwise), every ``megatron/core/…`` path the
    table names exists in the installed release, and each name in parentheses after it is
    defined there (a function, class or method, an assignment, or an import of that name);
(c) the parser and both checks find planted errors: a missing row, a row naming no file, an
    unknown source, a path or a name the release does not have.

Paths of Megatron-LM's ``megatron/training/`` (not in the megatron-core package) and of
TransformerEngine (not installed here) are not checked against a release.
"""
from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
from typing import Dict, List, NamedTuple, Optional, Set

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
BEGIN, END = "<!-- mirror-table: begin -->", "<!-- mirror-table: end -->"
SOURCES = ("megatron-core", "TransformerEngine", "torch.distributed")
FIRST_ENTRY = {"megatron-core": "megatron/core/", "TransformerEngine": "transformer_engine/",
               "torch.distributed": "torch.distributed"}
# `megatron/core/x.py` and, optionally, ` (`name`, `name`)` right after it.
MEGATRON_PATH = re.compile(r"`(megatron/core/[\w/]+\.py)`(?:\s*\(([^)]*)\))?")
BACKTICKED = re.compile(r"`([^`]+)`")


class Row(NamedTuple):
    line: int            # line number in the document
    file: str            # relative to mpu_lab/
    source: str
    mirrors: str
    notes: str


def table_rows(text: str) -> List[Row]:
    """The rows of the table between the markers; ValueError naming the line of a malformed
    row."""
    start = text.index(BEGIN)
    end = text.index(END, start)
    first = text.count("\n", 0, start) + 1
    rows = []
    lines = text[start:end].splitlines()[1:]
    body = [(first + 1 + i, line) for i, line in enumerate(lines) if line.strip()]
    if len(body) < 2 or not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", body[1][1].strip()):
        raise ValueError(f"ARCHITECTURE.md:{first}: no markdown table after {BEGIN}")
    for number, line in body[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4:
            raise ValueError(f"ARCHITECTURE.md:{number}: {len(cells)} cells, not 4: {line}")
        files = BACKTICKED.findall(cells[0])
        if len(files) != 1:
            raise ValueError(f"ARCHITECTURE.md:{number}: the file cell names {len(files)} paths")
        rows.append(Row(number, files[0], *cells[1:]))
    return rows


def mirror_files(package: pathlib.Path = ROOT / "mpu_lab") -> Set[str]:
    """Every .py file under ``package/core``, relative to ``package``."""
    return {p.relative_to(package).as_posix() for p in (package / "core").rglob("*.py")}


def tree_problems(rows: List[Row], files: Set[str]) -> List[str]:
    """(a) and the format: files without a row, rows without a file, duplicates, bad sources,
    a first mirrors entry of the wrong kind, a torch.distributed row naming no Megatron file."""
    problems = []
    named = [r.file for r in rows]
    problems += [f"no row for {f}" for f in sorted(files - set(named))]
    problems += [f"line {r.line}: {r.file} is not a file under mpu_lab/core/" for r in rows
                 if r.file not in files]
    problems += [f"{f} has {named.count(f)} rows" for f in sorted(set(named)) if named.count(f) > 1]
    for r in rows:
        if r.source not in SOURCES:
            problems.append(f"line {r.line}: source {r.source!r} is not one of {SOURCES}")
            continue
        entries = BACKTICKED.findall(r.mirrors)
        if not entries or not entries[0].startswith(FIRST_ENTRY[r.source]):
            problems.append(f"line {r.line}: a {r.source} row's mirrors start with "
                            f"`{FIRST_ENTRY[r.source]}…`, not {r.mirrors!r}")
        if r.source == "torch.distributed" and not MEGATRON_PATH.search(r.notes):
            problems.append(f"line {r.line}: a torch.distributed row names the Megatron-core "
                            f"file holding the equivalent logic in its notes")
    return problems


def megatron_references(rows: List[Row]) -> Dict[str, Set[str]]:
    """Every ``megatron/core/…`` path the table names, with the names claimed in it."""
    refs: Dict[str, Set[str]] = {}
    for r in rows:
        for match in MEGATRON_PATH.finditer(f"{r.mirrors} {r.notes}"):
            names = set(BACKTICKED.findall(match.group(2) or ""))
            refs.setdefault(match.group(1), set()).update(names)
    return refs


def defined_names(source: str) -> Set[str]:
    """Names a module defines anywhere (functions, classes, methods), assigns at its top level,
    or imports."""
    names: Set[str] = set()
    try:
        tree = ast.parse(source)
    except SyntaxError:           # a newer release's syntax: fall back to the text
        return set(re.findall(r"^\s*(?:async\s+def|def|class)\s+(\w+)", source, re.M))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def release_problems(refs: Dict[str, Set[str]], release: pathlib.Path) -> List[str]:
    """(b): paths missing from the release (``release`` is the folder holding ``megatron/``),
    and names a path's file does not define."""
    problems = []
    for path, names in sorted(refs.items()):
        file = release / path
        if not file.is_file():
            problems.append(f"{path}: not in the installed megatron-core")
            continue
        missing = names - defined_names(file.read_text(errors="replace"))
        problems += [f"{path}: defines no {name}" for name in sorted(missing)]
    return problems


def installed_release() -> Optional[pathlib.Path]:
    """The folder holding the installed ``megatron/`` package (``megatron.core`` itself is not
    imported: finding it imports only the ``megatron`` namespace)."""
    try:
        spec = importlib.util.find_spec("megatron.core")
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0]).parent.parent


@pytest.fixture(scope="module")
def rows() -> List[Row]:
    return table_rows(DOC.read_text())


def test_every_mirror_file_has_one_row_and_every_row_names_a_mirror_file(rows):
    assert len(rows) > 40                     # the markers still hold the table
    assert tree_problems(rows, mirror_files()) == []


def test_every_megatron_core_path_and_name_is_in_the_installed_release(rows):
    release = installed_release()
    if release is None:
        pytest.skip("megatron-core is not installed: the table's megatron/core paths are not checked")
    refs = megatron_references(rows)
    assert len(refs) > 25
    assert release_problems(refs, release) == []


# A small table in the documented format, for the planted errors below.
SAMPLE = f"""Some text.

{BEGIN}
| file | source | mirrors | notes |
|---|---|---|---|
| `core/a.py` | megatron-core | `megatron/core/a.py` (`f`, `C`) | |
| `core/b/__init__.py` | TransformerEngine | `transformer_engine/pytorch/x.py` (`G`) | `megatron/core/a.py` (`C`) calls it |
| `core/c.py` | torch.distributed | `torch.distributed` (`all_reduce`) | Megatron calls it in `megatron/core/b.py` |
{END}
"""


def sample_tree(tmp_path: pathlib.Path) -> pathlib.Path:
    package = tmp_path / "pkg"
    for name in ("core/a.py", "core/b/__init__.py", "core/c.py"):
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text("")
    release = tmp_path / "site"
    (release / "megatron/core").mkdir(parents=True)
    (release / "megatron/core/a.py").write_text(
        "from x import y\n\ndef f():\n    pass\n\nclass C:\n    def method(self):\n        pass\n")
    (release / "megatron/core/b.py").write_text("")
    return package


def test_the_checks_pass_a_well_formed_table_and_find_planted_errors(tmp_path):
    package = sample_tree(tmp_path)
    release = tmp_path / "site"
    rows = table_rows(SAMPLE)
    assert [r.file for r in rows] == ["core/a.py", "core/b/__init__.py", "core/c.py"]
    assert [r.line for r in rows] == [6, 7, 8]
    assert tree_problems(rows, mirror_files(package)) == []
    assert megatron_references(rows) == {"megatron/core/a.py": {"f", "C"}, "megatron/core/b.py": set()}
    assert release_problems(megatron_references(rows), release) == []

    # A missing row: the file it named is reported.
    missing = "\n".join(line for line in SAMPLE.splitlines() if "`core/c.py`" not in line)
    assert tree_problems(table_rows(missing), mirror_files(package)) == ["no row for core/c.py"]

    # A row for a file that is not there, a duplicate, an unknown source, a wrong first entry.
    (package / "core/c.py").unlink()
    assert tree_problems(rows, mirror_files(package)) == [
        "line 8: core/c.py is not a file under mpu_lab/core/"]
    (package / "core/c.py").write_text("")
    doubled = SAMPLE.replace(END, "| `core/a.py` | megatron core | `megatron/core/a.py` | |\n"
                                  "| `core/c.py` | TransformerEngine | `megatron/core/b.py` | |\n" + END)
    assert tree_problems(table_rows(doubled), mirror_files(package)) == [
        "core/a.py has 2 rows", "core/c.py has 2 rows",
        "line 9: source 'megatron core' is not one of "
        "('megatron-core', 'TransformerEngine', 'torch.distributed')",
        "line 10: a TransformerEngine row's mirrors start with `transformer_engine/…`, "
        "not '`megatron/core/b.py`'"]
    no_equivalent = SAMPLE.replace("Megatron calls it in `megatron/core/b.py`", "nothing")
    assert tree_problems(table_rows(no_equivalent), mirror_files(package)) == [
        "line 8: a torch.distributed row names the Megatron-core file holding the equivalent "
        "logic in its notes"]

    # A path and a name the release does not have; a method and an import count as defined.
    wrong = SAMPLE.replace("(`f`, `C`)", "(`f`, `method`, `y`, `gone`)").replace(
        "`megatron/core/b.py`", "`megatron/core/old.py`")
    assert release_problems(megatron_references(table_rows(wrong)), release) == [
        "megatron/core/a.py: defines no gone", "megatron/core/old.py: not in the installed megatron-core"]

    # A malformed row or a lost table is an error, not a silent pass.
    with pytest.raises(ValueError, match="cells, not 4"):
        table_rows(SAMPLE.replace("| `core/a.py` | megatron-core |", "| `core/a.py` |"))
    with pytest.raises(ValueError, match="names 0 paths"):
        table_rows(SAMPLE.replace("| `core/a.py` |", "| core/a.py |"))
    with pytest.raises(ValueError, match="no markdown table"):
        table_rows(f"{BEGIN}\n{END}\n")
