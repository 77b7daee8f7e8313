"""Each lab's summary restates its lessons, which answer its questions, so it is shown by a reveal
cell (stored empty) from labs/summaries/, never written in the notebook's prose, where a learner
who scrolls would read it before committing (mpu_lab.labkit.notebooks.summaries)."""
import json
import re

import pytest

from mpu_lab.labkit import REPO_ROOT
from mpu_lab.labkit.notebooks import summaries

LABS = sorted((REPO_ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))


def _cells(path):
    return [(c["cell_type"], "".join(c["source"]), c.get("metadata", {}).get("tags", []),
             c.get("outputs", [])) for c in json.loads(path.read_text())["cells"]]


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem[:2])
def test_the_summary_section_is_a_reveal_cell_showing_the_labs_own_file(path):
    cells = _cells(path)
    heads = [i for i, (kind, src, _, _) in enumerate(cells)
             if kind == "markdown" and src.startswith("## Summary")]
    assert len(heads) == 1, path.name
    kind, src, tags, outputs = cells[heads[0] + 1]
    assert kind == "code" and f'summaries.show("{path.stem}")' in src, path.name
    assert "reveal" in tags and "nbval-ignore-output" in tags and outputs == []
    assert not re.search(r"^- ", cells[heads[0]][1], re.M), "the summary's bullets stay out"
    assert summaries.summary_path(path.stem).read_text().startswith("- ")


def test_every_summary_file_belongs_to_a_lab_and_its_links_resolve_from_labs():
    assert sorted(p.stem for p in summaries.SUMMARIES_DIR.glob("*.md")) == [p.stem for p in LABS]
    for path in summaries.SUMMARIES_DIR.glob("*.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if not target.startswith("http"):
                assert (REPO_ROOT / "labs" / target).exists(), (path.name, target)


def test_show_prints_outside_a_notebook_and_names_the_summaries_it_has(capsys):
    summaries.show("01_rank_groups")
    assert capsys.readouterr().out == summaries.summary_path("01_rank_groups").read_text() + "\n"
    with pytest.raises(FileNotFoundError, match="no summary for lab '99_x'.*'01_rank_groups'"):
        summaries.show("99_x")
