"""A learner's notebook cell as the grader tests make one: the text run as IPython runs a cell
(module ``__main__``, its text kept in ``linecache`` under a made-up file name, so a traceback
and the grader's source lookup find the learner's lines), a right answer edited into a typical
mistake, and a piece the grader saved into the learner's package imported back."""
import importlib.util
import linecache
import pathlib


def run_cell(source: str, key: str) -> dict:
    """``source`` run as the cell ``<ipython-input-{key}>``: its namespace."""
    filename = f"<ipython-input-{key}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def edited(text: str, *changes) -> str:
    """``text`` with each ``(old, new)`` of ``changes`` made, each ``old`` found exactly once
    (a mistake that no longer applies to the right answer fails here, not as a false pass)."""
    for old, new in changes:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def import_file(path: pathlib.Path, name: str = "learner_piece"):
    """The module at ``path`` (a file the grader saved), imported under ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
