"""Readable outputs (issue 38 item 5): the check for stored output lines over 100 characters
(mpu_lab.labkit.notebooks.structure.wide_output_lines) on a hand-built notebook."""
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from mpu_lab.labkit.notebooks import structure


def _cell(*outputs):
    cell = new_code_cell("print(table)", execution_count=1)
    cell.outputs = list(outputs)
    return cell


def _notebook():
    nb = new_notebook()
    nb.cells = [
        new_markdown_cell("x" * 300),                                        # prose: not output
        _cell(new_output("stream", name="stdout", text="a" * 100 + "\n" + "b" * 101 + "\n")),
        _cell(new_output("stream", name="stderr", text="\x1b[31m" + "c" * 100 + "\x1b[0m\n")),
        _cell(new_output("execute_result", data={"text/plain": "d" * 120}, execution_count=1),
              new_output("display_data", data={"image/png": "iVBORw0KGgo=",
                                                "text/plain": "<Figure " + "e" * 200 + ">"})),
        _cell(new_output("stream", name="stdout", text="\t" * 12 + "f" * 5 + "   \n")),
    ]
    return nb


def test_lines_over_100_characters_of_text_outputs_are_found_and_nothing_else():
    wide = structure.wide_output_lines(_notebook())
    # cell 1's 101 b's; cell 3's text/plain of 120; cell 4: 12 tabs (96) + 5 = 101 columns.
    # Not: exactly 100 a's, 100 c's inside colour codes, a figure's stand-in, the prose.
    assert [(cell, length) for cell, length, _ in wide] == [(1, 101), (3, 120), (4, 101)]
    assert structure.wide_output_lines(_notebook(), limit=120) == []


def test_the_problem_names_the_cell_the_count_and_the_longest_line():
    nb = _notebook()
    nb.cells[1].outputs[0]["text"] += "g" * 150 + "\n"
    problems = structure.output_width_problems(nb)
    assert problems[0].startswith("cell 1 prints 2 line(s) over 100 characters (longest 150)")
    assert [p.split(" prints")[0] for p in problems] == ["cell 1", "cell 3", "cell 4"]
