"""Start_Here's lab times (mpu_lab.labkit.notebooks.sizing) on notebooks whose words, stored
outputs, figures, exercises and questions are counted by hand."""
import json

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from mpu_lab.labkit.notebooks import sizing, solutions


def _lab(tmp_path, name="95_example"):
    nb = new_notebook()
    nb.cells = [
        new_code_cell("world_size = 2", metadata={"tags": ["parameters"]}),   # not counted
        new_markdown_cell("# Lab 07: an example\n\nSix words of prose here."),  # 9 words
        new_code_cell("exercises.grade(my_f, EX, world)"),                     # 5 words, 1 exercise
        new_code_cell("answer = None\ncheck_shape(answer)"),                   # 4 words, 1 question
        new_markdown_cell("## Going further: more\n\nthree more words"),       # 6 words, extra
        new_code_cell("check_other(answer)"),                                  # extra: 2 words, 1 question
    ]
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(nb, str(path))
    return path


def test_words_exercises_and_questions_counted_by_hand(tmp_path):
    size = sizing.lab_size(_lab(tmp_path), {"95_example": 90.0})
    assert (size.core_words, size.extra_words, size.exercises, size.questions) == (18, 8, 1, 1)
    # reading and running: 18 / 120 + 2 + 1.5 minutes; the exercise (10 min) is a build beside
    assert abs(size.core_minutes - (18 / 120 + 2 + 1.5)) < 1e-9
    assert size.builds == [sizing.Build("my_f", 1, 10.0, marked=False)]
    assert size.build_minutes == 10.0
    assert abs(size.extra_minutes - (8 / 120 + 2)) < 1e-9   # the depth's question counts there


def test_recorded_seconds_merge_by_stem_with_the_machine(tmp_path):
    times = tmp_path / "compute_times.json"
    sizing.record_compute_times({"95_example.ipynb": 61.4}, times)
    sizing.record_compute_times({"01_first.ipynb": 9.6}, times)
    data = json.loads(times.read_text())
    assert data["seconds"] == {"01_first": 10, "95_example": 61}
    assert "CPU cores" in data["machine"]
    assert sizing.load_compute_times(times) == {"01_first": 10.0, "95_example": 61.0}


def test_the_table_flags_a_core_over_budget(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sizing, "TIMES_FILE", tmp_path / "none.json")
    path = _lab(tmp_path)
    nb = nbformat.read(str(path), 4)
    nb.cells.insert(1, new_markdown_cell("word " * (sizing.WORDS_PER_MINUTE * 44)))
    nbformat.write(nb, str(path))
    sizing.print_lab_sizes([path])
    out = capsys.readouterr().out
    assert "95_example" in out and "n/a" in out
    assert f"cores over {sizing.CORE_BUDGET_MIN} min: 95_example" in out


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
    assert [name for name, _ in sections] == ["Lab 07: an example", "Going further: more"]
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


SOLUTION = '''"""Lab 96's solutions."""
import torch


def solution_a(x):
    """The docstring is the exercise's: not counted."""
    # a comment: not counted
    y = x + 1

    z = torch.cat([y,
                   y])          # one statement on two lines: 2 lines
    return z


def solution_b(x):
    return x
'''


def _with_outputs(cell, *outputs, tags=()):
    cell.execution_count = 1
    cell.outputs = list(outputs)
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def _read_and_written_lab(tmp_path, monkeypatch):
    """Lab 96: prose, stored outputs read and unread, two figures, an exercise whose solution
    is on file and one whose is not, a question; a Going further with one more figure."""
    (tmp_path / "96_example.py").write_text(SOLUTION)
    monkeypatch.setattr(solutions, "SOLUTIONS_DIR", tmp_path)
    monkeypatch.setitem(solutions.SOLUTIONS, "96", solutions.Solution(
        "96_example.py", {"my_a": "solution_a", "my_b": "solution_b"}))
    figure = {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure size 640x480 with 1 Axes>"}
    nb = new_notebook()
    nb.cells = [
        new_markdown_cell("# Lab 96\n\nFour words of prose."),                 # 6 words
        _with_outputs(new_code_cell("print(x)"),                               # 2 words
                      new_output("stream", name="stdout", text="one two three\n"),   # 3 read
                      new_output("stream", name="stderr", text="a warning here\n"),  # unread
                      new_output("execute_result", data={"text/plain": "[4, 5]"},
                                 execution_count=1)),                          # 2 read
        _with_outputs(new_code_cell("plot(x)"),                                # 2 words
                      new_output("display_data", data=figure),                 # 1 figure
                      new_output("execute_result", data=figure, execution_count=1)),  # 1 figure
        _with_outputs(new_code_cell("show(x)"),                                # 2 words
                      new_output("stream", name="stdout", text="not read at all\n"),
                      new_output("display_data", data=figure), tags=["remove-output"]),
        new_code_cell("grade((my_a, my_b), EX, world)"),           # 5 words, (4 + 1) lines
        new_code_cell("grade(my_c, EX, world)"),                   # 4 words, no solution: 10 min
        new_code_cell("answer = None\ncheck_x(answer)"),           # 4 words, 1 question
        new_markdown_cell("## Going further: more"),               # 3 words, extra
        _with_outputs(new_code_cell("plot(y)"), new_output("display_data", data=figure)),
    ]
    path = tmp_path / "96_example.ipynb"
    nbformat.write(nb, str(path))
    return path


def test_solution_logic_lines_leave_out_the_docstring_comments_and_blank_lines(tmp_path,
                                                                                monkeypatch):
    _read_and_written_lab(tmp_path, monkeypatch)
    assert sizing.solution_logic_lines("96") == {"my_a": 4, "my_b": 1}
    assert sizing.solution_logic_lines("95") == {}
    assert sizing.exercise_minutes(5) == 3 + 2.5


def test_outputs_read_figures_and_exercises_by_their_solutions_counted_by_hand(tmp_path,
                                                                             monkeypatch):
    size = sizing.lab_size(_read_and_written_lab(tmp_path, monkeypatch), {"96_example": 30.0})
    core = size.core
    assert (core.words, core.output_words, core.figures) == (6 + 2 + 2 + 2 + 5 + 4 + 4, 3 + 2, 2)
    assert (core.exercises, core.questions) == (2, 1)
    # the tuple grades my_a (4 lines) and my_b (1): 3 + 5/2 min; my_c has no solution: 10 min
    assert core.exercise_min == 5.5 + 10
    # reading and running only: the two exercises' 15.5 min are builds, beside the core
    assert abs(size.core_minutes - ((25 + 5) / 120 + 2 * 1 + 2 + 0.5)) < 1e-9
    assert [(b.name, b.minutes) for b in size.builds] == [("my_a, my_b", 5.5), ("my_c", 10)]
    assert (size.extra.words, size.extra.figures) == (3 + 2, 1)
    assert abs(size.extra_minutes - (5 / 120 + 1)) < 1e-9


def test_the_table_keeps_its_lines_within_100_characters(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sizing, "TIMES_FILE", tmp_path / "none.json")
    path = _read_and_written_lab(tmp_path, monkeypatch)
    long_name = path.with_name("99_parallel_transformer.ipynb")
    path.rename(long_name)
    sizes = sizing.lab_sizes([long_name])
    for measured in ((135.0, 2), (35.0, 12)):
        table = sizing.format_lab_sizes(sizes, {"99_parallel_transformer": measured}, "measured")
        assert f"{measured[0]:.0f} min ({measured[1]})" in table
        assert max(len(line) for line in table.splitlines()) <= 100
    sizing.print_lab_sizes([long_name])
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 100


def _built_lab(tmp_path, monkeypatch):
    """Lab 97: two marked builds (one of two exercises), an exercise outside any build, a
    build in Going further; solutions of 6, 2 and 3 logic lines, one a class."""
    (tmp_path / "97_example.py").write_text(CLASS_SOLUTION)
    monkeypatch.setattr(solutions, "SOLUTIONS_DIR", tmp_path)
    monkeypatch.setitem(solutions.SOLUTIONS, "97", solutions.Solution(
        "97_example.py", {"MyRow": "SolutionRow", "my_hook": "solution_hook",
                          "my_step": "solution_step"}))
    nb = new_notebook()
    nb.cells = [
        new_markdown_cell("# Lab 97"),                                 # 2 words
        new_markdown_cell("## 1. Layers"),                             # 2 words
        new_markdown_cell("### Build: RowParallelLinear\n\nWrite it."),  # 4 words
        new_code_cell("grade(MyRow, EX, world)"),                      # 4 words, 6 lines
        new_markdown_cell("### Build: the hook and the step"),         # 6 words
        new_code_cell("grade(my_hook, EX, world)"),                    # 4 words, 2 lines
        new_code_cell("grade(my_step, EX, world)"),                    # 4 words, 3 lines
        new_markdown_cell("### An aside\n\nno build here"),            # 5 words: ends it
        new_code_cell("grade(my_other, EX, world)"),                   # 4 words, unmarked: 10 min
        new_markdown_cell("## Going further: more\n\n### Build: extra"),  # extra: 5 words
        new_code_cell("grade(my_hook, EX, world)"),                    # extra's writing
    ]
    path = tmp_path / "97_example.ipynb"
    nbformat.write(nb, str(path))
    return path


CLASS_SOLUTION = '''"""Lab 97's solutions."""
import torch


class SolutionRow(torch.nn.Module):
    """The docstring: not counted."""
    bias = None                               # a class-level statement: 1 line

    def __init__(self, w):
        """Not counted either."""
        super().__init__()
        self.w = w

    def forward(self, x):
        # a comment: not counted
        y = x @ self.w.t()
        return y, None


def solution_hook(param, state):
    state.counts[param] += 1
    return state


def solution_step(p, lr):
    p = p - lr
    p = p * 1
    return p
'''


def test_a_class_solution_counts_its_methods_bodies_and_class_statements(tmp_path, monkeypatch):
    _built_lab(tmp_path, monkeypatch)
    # bias = None; super().__init__(); self.w = w; y = ...; return y, None
    assert sizing.solution_logic_lines("97") == {"MyRow": 5, "my_hook": 2, "my_step": 3}


def test_builds_are_the_marked_sections_and_their_writing_is_not_in_the_core(tmp_path,
                                                                              monkeypatch):
    size = sizing.lab_size(_built_lab(tmp_path, monkeypatch), {"97_example": 60.0})
    # a marked build's cells are read while writing it: their words go to the build, not the core
    got = [(b.name, b.exercises, b.minutes, b.marked) for b in size.builds]
    expected = [("RowParallelLinear", 1, (4 + 4) / 120 + 3 + 5 / 2, True),
                ("the hook and the step", 2, (6 + 4 + 4) / 120 + (3 + 2 / 2) + (3 + 3 / 2), True),
                ("my_other", 1, 10, False)]
    assert [g[:2] + g[3:] for g in got] == [e[:2] + e[3:] for e in expected]
    assert all(abs(g[2] - e[2]) < 1e-9 for g, e in zip(got, expected))
    words = 2 + 2 + 5 + 4                  # the headings, the aside and the unmarked exercise
    assert abs(size.core_minutes - (words / 120 + 1)) < 1e-9       # reading and one minute run
    # the build in Going further: its heading cell's 5 words, the cell's 4, 4 min of writing
    assert abs(size.extra_minutes - ((5 + 4) / 120 + 3 + 2 / 2)) < 1e-9


def test_sections_show_each_build_and_what_follows_it(tmp_path, monkeypatch):
    sections = dict(sizing.section_minutes(_built_lab(tmp_path, monkeypatch)))
    assert list(sections) == ["Lab 97", "1. Layers", "Build: RowParallelLinear",
                              "Build: the hook and the step", "1. Layers (cont.)",
                              "Going further: more", "Build: extra"]
    assert abs(sections["Build: RowParallelLinear"] - ((4 + 4) / 120 + 5.5)) < 1e-9
    assert abs(sections["1. Layers (cont.)"] - ((5 + 4) / 120 + 10)) < 1e-9


def test_the_table_and_the_build_list_print_each_build_with_its_minutes(tmp_path, monkeypatch,
                                                                        capsys):
    monkeypatch.setattr(sizing, "TIMES_FILE", tmp_path / "none.json")
    sizing.print_lab_sizes([_built_lab(tmp_path, monkeypatch)])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("97_example"))
    assert "3: 24 min" in row
    assert ("97_example: RowParallelLinear 6 min; the hook and the step 9 min; "
            "my_other (unmarked) 10 min") in out
    assert max(len(line) for line in out.splitlines()) <= 100
