"""Each lab's summary, shown by a reveal cell once the learner has answered the lab's questions.

A summary restates the lab's lessons, and a lesson is the answer to one of its questions: in the
notebook's prose a learner who scrolls would read it before committing (the leak check reads
everything below a question, and a collapsed ``<details>`` block is one click from it). So the
text lives in ``labs/summaries/NN_topic.md``, and the lab's "Summary" section is a code cell,
tagged ``reveal`` and stored empty, that shows it (:func:`show`): rendered as Markdown in
Jupyter, printed elsewhere.
"""
from __future__ import annotations

import pathlib

from mpu_lab.labkit import REPO_ROOT

SUMMARIES_DIR = REPO_ROOT / "labs" / "summaries"


def summary_path(lab: str) -> pathlib.Path:
    """The summary file of ``lab`` (its notebook's stem, ``05_sharded_data_parallel``)."""
    path = SUMMARIES_DIR / f"{lab}.md"
    if not path.exists():
        have = sorted(p.stem for p in SUMMARIES_DIR.glob("*.md"))
        raise FileNotFoundError(f"no summary for lab {lab!r} in {SUMMARIES_DIR}; there are {have}")
    return path


def show(lab: str) -> None:
    """Show ``lab``'s summary: as Markdown in a notebook (its links resolve from ``labs/``),
    as text anywhere else."""
    text = summary_path(lab).read_text()
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:          # no IPython: a plain interpreter
        print(text)
        return
    if get_ipython() is None:
        print(text)
    else:
        display(Markdown(text))


__all__ = ["SUMMARIES_DIR", "summary_path", "show"]
