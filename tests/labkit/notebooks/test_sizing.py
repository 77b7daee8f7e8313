"""Start_Here's lab times (mpu_lab.labkit.notebooks.sizing) on notebooks whose words, exercises
and questions are counted by hand."""
import json

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from mpu_lab.labkit.notebooks import sizing


def _lab(tmp_path, name="05_example"):
    nb = new_notebook()
    nb.cells = [
        new_code_cell("world_size = 2", metadata={"tags": ["parameters"]}),   # not counted
        new_markdown_cell("# Lab 05: an example\n\nSix words of prose here."),  # 9 words
        new_code_cell("exercises.grade(my_f, EX, world)"),                     # 5 words, 1 exercise
        new_code_cell("answer = None\ncheck_shape(answer)"),                   # 4 words, 1 question
        new_markdown_cell("## Going further: more\n\nthree more words"),       # 6 words, extra
        new_code_cell("check_other(answer)"),                                  # extra: 2 words, 1 question
    ]
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(nb, str(path))
    return path


def test_words_exercises_and_questions_counted_by_hand(tmp_path):
    size = sizing.lab_size(_lab(tmp_path), {"05_example": 90.0})
    assert (size.core_words, size.extra_words, size.exercises, size.questions) == (18, 8, 1, 1)
    # 18 / 120 + 10 + 2 + 1.5 minutes
    assert abs(size.core_minutes - (18 / 120 + 10 + 2 + 1.5)) < 1e-9
    assert abs(size.extra_minutes - (8 / 120 + 2)) < 1e-9   # the depth's question counts there


def test_recorded_seconds_merge_by_stem_with_the_machine(tmp_path):
    times = tmp_path / "compute_times.json"
    sizing.record_compute_times({"05_example.ipynb": 61.4}, times)
    sizing.record_compute_times({"01_first.ipynb": 9.6}, times)
    data = json.loads(times.read_text())
    assert data["seconds"] == {"01_first": 10, "05_example": 61}
    assert "CPU cores" in data["machine"]
    assert sizing.load_compute_times(times) == {"01_first": 10.0, "05_example": 61.0}


def test_the_table_flags_a_core_over_budget(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sizing, "TIMES_FILE", tmp_path / "none.json")
    path = _lab(tmp_path)
    nb = nbformat.read(str(path), 4)
    nb.cells.insert(1, new_markdown_cell("word " * (sizing.WORDS_PER_MINUTE * 40)))
    nbformat.write(nb, str(path))
    sizing.print_lab_sizes([path])
    out = capsys.readouterr().out
    assert "05_example" in out and "n/a" in out
    assert f"cores over {sizing.CORE_BUDGET_MIN} min: 05_example" in out


def test_a_link_target_a_bare_url_and_an_html_tag_are_not_read(tmp_path):
    nb = new_notebook()
    nb.cells = [new_markdown_cell(
        "See [the paper](https://arxiv.org/abs/1909.08053) or https://example.org/a/b/c.\n"
        '<img src="figures/x.png" width="400"/> and $a < b$, $c > d$.'),   # 11 words read
        new_code_cell("url = 'https://example.org/a'")]                     # code: 5 words
    path = tmp_path / "06_links.ipynb"
    nbformat.write(nb, str(path))
    # See the paper or and a b c d = 9 words ... counted by hand:
    # "See", "the", "paper", "or", "and", "a", "b", "c", "d"
    assert sizing.lab_size(path).core_words == 9 + 5


def test_section_minutes_split_a_lab_by_its_headings(tmp_path):
    path = _lab(tmp_path)
    sections = sizing.section_minutes(path)
    assert [name for name, _ in sections] == ["Lab 05: an example", "Going further: more"]
    # the title's 9 words + the grade cell (5 words, 10 min) + the check cell (4 words, 2 min)
    assert abs(sections[0][1] - ((9 + 5 + 4) / 120 + 10 + 2)) < 1e-9
    assert abs(sections[1][1] - (8 / 120 + 2)) < 1e-9   # 6 + 2 words and check_other's question


def test_the_sizes_command_prints_the_table_and_the_sections(capsys):
    from mpu_lab.labkit.notebooks.cli import main
    assert main(["sizes", "--only", "01"]) == 0
    assert "01_rank_groups" in capsys.readouterr().out
    assert main(["sizes", "--sections", "--only", "01"]) == 0
    out = capsys.readouterr().out
    assert "Summary" in out and " min " in out
