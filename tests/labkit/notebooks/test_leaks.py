"""The leak check (mpu_lab.labkit.notebooks.leaks, issue 38 item 1) on hand-built notebooks: it
catches each of the three kinds of leak the issue names (an answer in the prose or a figure's
labels above the question, an answer in a stored output or prose anywhere below the learner's
answer cell, a reveal cell stored with its outputs), passes a clean notebook, and matches
answers by the stated rules."""
import fractions

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from mpu_lab.labkit.notebooks import leaks
from mpu_lab.labkit.notebooks.leaks import Answer


def _run(source, text, tags=(), count=1):
    """A code cell stored with one stdout stream output."""
    cell = new_code_cell(source, metadata={"tags": list(tags)} if tags else {},
                         execution_count=count)
    cell.outputs = [new_output("stream", name="stdout", text=text)]
    return cell


def _figure(source, count=1):
    cell = new_code_cell(source, execution_count=count)
    cell.outputs = [new_output("execute_result", data={"image/png": "iVBORw0KGgo=",
                                                       "text/plain": "<Figure size 640x480>"},
                               execution_count=count)]
    return cell


QUESTION = new_markdown_cell("**Predict:** how many all-reduces does the MLP issue forward and "
                             "backward? Answer as a pair `(forward, backward)`.")
COMMIT = new_code_cell("answer = None   # (forward, backward)\ncheck_mlp_all_reduces(answer)")
MLP = Answer("07", "mlp all-reduces", ((1, 1),), "check_mlp_all_reduces(")
BUBBLE = Answer("11", "bubble share", (fractions.Fraction(1, 9),), "check_bubble_share(")


def _clean():
    nb = new_notebook()
    nb.cells = [
        new_markdown_cell("# Lab 07\n\n## 3. The MLP\n\nThe operator g adds the partial sums."),
        _figure('plot_fg(tp, title="f and g around the MLP")'),
        QUESTION, COMMIT,
        new_code_cell("print(counts)", metadata={"tags": ["reveal", "nbval-ignore-output"]}),
        new_markdown_cell("So the MLP all-reduces once each way: f in backward, g in forward."),
    ]
    return nb


def test_a_clean_notebook_has_no_leak():
    assert leaks.find_leaks(_clean(), [MLP], "07") == []


def test_an_answer_in_the_prose_above_the_question_is_caught():
    nb = _clean()
    nb.cells[0] = new_markdown_cell("# Lab 07\n\n## 3. The MLP\n\nIt all-reduces (1, 1): f "
                                    "backward, g forward.")
    (leak,) = leaks.find_leaks(nb, [MLP], "07")
    assert (leak.cell, leak.where, leak.text, leak.weak) == (0, "prose above", "(1, 1)", False)


def test_an_answer_in_a_figure_title_written_in_code_above_is_caught():
    nb = _clean()
    nb.cells[1] = _figure('plot_fg(tp, title="all-reduces per pass (forward, backward): (1, 1)")')
    (leak,) = leaks.find_leaks(nb, [MLP], "07")
    assert (leak.cell, leak.text) == (1, "(1, 1)")
    assert leak.where.startswith("code above")


def test_an_answer_in_a_stored_output_of_an_earlier_section_is_caught():
    nb = _clean()
    nb.cells.insert(1, _run("print(counts)", "forward, backward all-reduces: [1, 1]\n"))
    (leak,) = leaks.find_leaks(nb, [MLP], "07")
    assert (leak.cell, leak.where, leak.text) == (1, "output above", "[1, 1]")


def test_an_answer_printed_by_the_next_cells_stored_output_is_caught():
    nb = new_notebook()
    nb.cells = [
        new_markdown_cell("## 4. A bubble\n\n**Predict** first: with p = 2 stages and m = 8 "
                          "micro-batches, what share of the iteration is idle?"),
        new_code_cell("answer = None\ncheck_bubble_share(answer, p=2, m=8)", execution_count=1),
        _run("print(bubble.summary())", "   m  (p-1)/(m+p-1)\n   8           0.11\n", count=2),
        new_markdown_cell("The measured share sits above the formula's."),
        _run("print(later)", "0.11 again, after the learner has read on\n", count=3),
    ]
    found = leaks.find_leaks(nb, [BUBBLE], "11")
    assert [(x.cell, x.text, x.where) for x in found] == [
        (2, "0.11", "output below, stored"), (4, "0.11", "output below, stored")]


def test_below_the_answer_cell_prose_and_later_sections_count_and_small_numbers_stay_local():
    """A learner can scroll before committing: prose below the answer cell that states it is
    a leak, in its section or later; a small number (weak) only counts in the answer's own
    section, which ends at the next heading."""
    nb = _clean()
    nb.cells.append(new_markdown_cell("## 4. Next\n\nThe MLP all-reduced (1, 1) times."))
    (leak,) = leaks.find_leaks(nb, [MLP], "07")
    assert (leak.cell, leak.where, leak.text) == (6, "prose below", "(1, 1)")
    ranks = Answer("13", "expert-DP size", (4,), "check_expert_data_parallel_size(")
    nb = new_notebook()
    nb.cells = [
        new_markdown_cell("## 2. Where experts live\n\n**Predict:** on how many ranks?"),
        new_code_cell("answer = None\ncheck_expert_data_parallel_size(answer, 16, 2, 2, 2)"),
        new_markdown_cell("Each expert lives on 4 ranks.\n\n## 3. Routing\n\nA layer has 4 "
                          "experts."),
        _run("print(experts)", "4 experts\n", count=2),
    ]
    (leak,) = leaks.find_leaks(nb, [ranks])
    assert (leak.cell, leak.where, leak.text, leak.weak) == (2, "prose below", "4", True)


def test_reveal_cells_stored_with_outputs_are_caught_tagged_or_calling_reveal():
    nb = _clean()
    nb.cells[4] = _run("print(counts)", "forward 1, backward 1\n", tags=["reveal"], count=2)
    nb.cells.append(_run("exercises.debugging.reveal(run.fault, run)",
                         "it was --inject-fault hang:1\n", count=3))
    nb.cells.append(new_code_cell("reveal(check_bounds, traffic)",
                                  metadata={"tags": ["reveal"]}))     # stored empty: fine
    found = leaks.reveal_leaks(nb, "07")
    assert [(x.cell, x.where) for x in found] == [(4, "reveal cell stored with outputs"),
                                                  (6, "reveal cell stored with outputs")]
    assert "hang:1" in found[1].text
    assert len(leaks.find_leaks(nb, [MLP], "07")) == 2


def test_the_question_itself_is_not_its_answer_but_the_rest_of_its_cell_is():
    shape = Answer("06", "weight shape", ((192, 1024),), "check_column_weight_shape(")
    nb = new_notebook()
    nb.cells = [
        new_markdown_cell("## 5. Shapes\n\n**Predict:** with input 1024 and output 768 at "
                          "t = 4, is the weight (192, 1024) or (1024, 192)?"),
        new_code_cell("answer = None   # e.g. (192, 1024)\n"
                      "check_column_weight_shape(answer, input_size=1024, output_size=768, tp=4)"),
    ]
    assert leaks.find_leaks(nb, [shape]) == []
    nb.cells[0].source += "\n\nEach rank stores weight (192, 1024)."
    (leak,) = leaks.find_leaks(nb, [shape])
    assert (leak.cell, leak.where, leak.text) == (0, "prose above", "(192, 1024)")


def test_a_small_number_is_weak_and_searched_only_in_its_own_section():
    ranks = Answer("13", "expert-DP size", (4,), "check_expert_data_parallel_size(")
    nb = new_notebook()
    nb.cells = [
        new_markdown_cell("## 1. Experts\n\nA layer has 4 experts."),      # another section
        new_markdown_cell("## 2. Where experts live\n\nEach expert lives on 4 ranks."),
        new_code_cell("answer = None\ncheck_expert_data_parallel_size(answer, 16, 2, 2, 2)"),
    ]
    (leak,) = leaks.find_leaks(nb, [ranks])
    assert (leak.cell, leak.text, leak.weak) == (1, "4", True)
    assert "weak" in str(leak)


@pytest.mark.parametrize("text, value, expected", [
    ("groups 2, 12, 20 and x2 and 0.2 and 2.5 and 2**3 and 2.", 2, ["2", "2", "2"]),
    ("padded to 50,304 (50304.0), not 50304.5", 50304, ["50,304", "50304.0"]),
    ("8 % of the time, 8x faster", 8, ["8"]),
    ("pair (1, 0) or [1,0]; not (1, 0, 0) nor (0, 1)", (1, 0), ["(1, 0)", "[1,0]"]),
    ("A0= torch.Size([4, 8]); 4 x 8; [8, 4]", [4, 8], ["[4, 8]", "([4, 8])", "4 x 8"]),
    ("ranks 2, 6, 10, 14 or [2, 6, 10, 14]; 2, 6, 10, 14, 18", [2, 6, 10, 14],
     ["[2, 6, 10, 14]", "2, 6, 10, 14"]),
    ("x.grad = tensor([3., 3.]) or [[3.0, 3.0]]", [[3.0, 3.0]],
     ["[3., 3.]", "([3., 3.])", "[3.0, 3.0]", "[[3.0, 3.0]]"]),
    ("idle 0.11 = 11 % = 11.1%; 0.1 and 0.12 and 1.11", 1 / 9, ["0.11", "11 %", "11.1%"]),
    ("3/11 = 27.3%, not 13/11", fractions.Fraction(3, 11), ["3/11", "27.3%"]),
    ("1.78x faster; 3.6 GB", 1.7778, ["1.78"]),
    ('cause "C", not C. or Cause', "C", ['"C"']),
    ("the Wrong  Group, not wrong-grouping", "wrong group", ["Wrong  Group"]),
])
def test_answers_are_matched_by_the_stated_rules(text, value, expected):
    assert [t for t, _ in leaks.hits(text, value)] == expected


def test_declared_answers_are_registered_by_lab_and_replaced_by_question():
    made = leaks.declare_answers([("98", "q1", [(1, 1), "one each way"], "check_a("),
                                  ("98", "q2", 7, "check_b(", 1)])
    assert made[0].answers == ((1, 1), "one each way") and made[1].answers == (7,)
    assert made[1].occurrence == 1
    leaks.declare_answers([("98", "q1", 3, "check_c(")])
    assert [(a.question, a.answers) for a in leaks.declared_answers("98")] == [("q1", (3,)),
                                                                                ("q2", (7,))]
    with pytest.raises(ValueError, match="lab, question, answers, commit"):
        leaks.declare_answers([("98", "q3", 1)])


def test_an_answer_cell_that_is_not_there_is_named():
    missing = Answer("07", "mlp all-reduces", ((1, 1),), "check_mlp_all_reduces(", occurrence=1)
    with pytest.raises(ValueError, match=r"mlp all-reduces.*1 code cell\(s\).*occurrence 1"):
        leaks.find_leaks(_clean(), [missing])


def test_a_notebook_file_is_checked_with_its_labs_declared_answers(tmp_path):
    nb = _clean()
    nb.cells[0].source += "\n\nIt all-reduces (1, 1)."
    path = tmp_path / "97_example.ipynb"
    nbformat.write(nb, str(path))
    leaks.declare_answers([("97", "mlp all-reduces", [(1, 1)], "check_mlp_all_reduces(")])
    (leak,) = leaks.notebook_leaks(path)
    assert (leak.lab, leak.cell, leak.text) == ("97", 0, "(1, 1)")
    assert "lab 97 cell 0: 'mlp all-reduces' answered in the prose above" in str(leak)


def test_numbering_and_the_answer_cells_no_answer_line_are_not_answers():
    choice = Answer("16", "dominant communication", ("tp", 9), "check_dominant_communication(")
    commit = new_code_cell('answer = None   # "tp", "pp" or "dp"\n'
                           'check_dominant_communication(answer)', execution_count=1)
    commit.outputs = [new_output("stream", name="stdout",
                                 text='No answer yet: replace None with "tp", "pp" or "dp".\n')]
    nb = new_notebook()
    nb.cells = [new_markdown_cell("## 9. Exercises\n\n**1.** Which one?\n\n9. a list item"),
                commit]
    assert leaks.find_leaks(nb, [choice]) == []
    commit.outputs[0]["text"] += 'Right: "tp" is 9 % of it.\n'
    (leak,) = leaks.find_leaks(nb, [choice])
    assert (leak.cell, leak.where, leak.text) == (1, "answer cell's stored output", '"tp"')
