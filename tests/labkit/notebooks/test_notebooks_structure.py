"""The committed notebooks are fit for nbval and papermill; the instructor tooling works.

No kernel starts here except in the nbval-plugin test; nbval itself (run by `python -m pytest`
through pyproject's addopts) executes the notebooks and compares their outputs.
"""
import io
import json
import pathlib
import re
import subprocess
import sys

import nbformat
import pytest

from mpu_lab.labkit import notebooks

REPO = pathlib.Path(__file__).resolve().parents[3]
LABS = sorted((REPO / "labs").glob("*.ipynb"))
SANITIZE = REPO / "tests" / "nbval_sanitize.cfg"


def test_committed_notebooks_have_no_structural_problems():
    assert notebooks.structure_problems(REPO) == []


def test_the_series_is_start_here_and_labs_01_to_05_and_07_at_least():
    names = [p.name for p in notebooks.notebook_paths(REPO)]
    assert names[0] == "Start_Here.ipynb"
    for lab in ("01_rank_groups", "06_column_parallel", "07_row_parallel", "08_tp_mappings",
                "09_parallel_transformer", "14_train_gpt"):
        assert f"{lab}.ipynb" in names


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_lab_parameters_are_cpu_safe(path):
    import papermill
    params = papermill.inspect_notebook(str(path))
    assert {"world_size", "backend"} <= set(params), sorted(params)
    assert int(params["world_size"]["default"]) <= 8
    assert params["backend"]["default"] == '"auto"'


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_lab_outputs_are_executed_in_order_without_widget_state(path):
    nb = json.loads(path.read_text())
    counts = [c["execution_count"] for c in nb["cells"] if c["cell_type"] == "code"]
    assert counts == list(range(1, len(counts) + 1))      # one clean top-to-bottom run
    assert "widgets" not in nb["metadata"] and "papermill" not in nb["metadata"]
    assert nb["metadata"]["kernelspec"]["name"] == "python3"


def test_start_here_links_the_written_labs_and_lists_coming_ones_without_links():
    text = "\n".join(c.source for c in nbformat.read(REPO / "Start_Here.ipynb", 4).cells
                     if c.cell_type == "markdown")
    for lab in [f"{n:02d}" for n in range(1, 19)]:
        written = list((REPO / "labs").glob(f"{lab}_*.ipynb"))
        row = [line for line in text.splitlines() if line.startswith((f"| {lab} ", f"| [{lab} "))]
        assert row, lab
        if written:
            assert f"](labs/{written[0].name})" in row[0] and "(coming)" not in row[0]
        else:
            assert "(coming)" in row[0] and "](" not in row[0]


# --------------------------------------------------------------------------- the checker itself
def write_nb(path, cells, **metadata):
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    nb.metadata.update({"kernelspec": dict(notebooks.KERNELSPEC)}, **metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))


def test_structure_checker_flags_what_breaks_nbval_and_papermill(tmp_path):
    bad = nbformat.v4.new_code_cell("1 / 0")
    bad.outputs = [nbformat.v4.new_output("error", ename="ZeroDivisionError", evalue="", traceback=[])]
    bad.execution_count = None
    write_nb(tmp_path / "labs" / "99_bad.ipynb", [
        nbformat.v4.new_markdown_cell("# no objectives here, see [gone](missing.ipynb)"),
        bad,
        nbformat.v4.new_code_cell("\n".join(f"x{i} = {i}" for i in range(12))),
    ], widgets={"state": {}})
    problems = "\n".join(notebooks.structure_problems(tmp_path))
    for needle in ("saved widget state", "stores an error output", "has outputs but no execution_count",
                   "0 cells tagged 'parameters'", "links to missing missing.ipynb",
                   "12 lines of logic", "learning objectives", "lacks a 'Previous' link",
                   "no torchrun job", "no exercise check"):
        assert needle in problems, needle


def _executed(source, outputs=(), tags=()):
    cell = nbformat.v4.new_code_cell(source)
    cell.execution_count = 1
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=t) for t in outputs]
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def test_lesson_checker_flags_an_answer_stored_under_its_prediction_question(tmp_path):
    md = nbformat.v4.new_markdown_cell
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        md("**Predict, then run.** What is x.grad on rank 3?"),
        _executed("world.run('x.grad')", ["[6.0, 6.0]"]),                        # spoiler
        md("Predict: how many all-reduces?"),
        _executed("answer = None\ncheck_count(answer)", ["No answer yet: ..."]),   # commits first
        md("We predicted it right."),                                          # not a question
        _executed("print(2)", ["2"]),
        md("**Predict** the order."),
        _executed("print(order)", [], tags=["reveal", "nbval-ignore-output"]),  # stored unrun
        md("Predict the shape."),
        _executed("print(shape)", ["(4, 2)"], tags=["reveal"]),                # outputs kept
    ]
    problems = notebooks.lesson_problems(nb, "01")
    assert problems[0] == "cell 1 answers the prediction asked in cell 0 in its stored output: " \
        "let the learner commit first (answer = None and a check), or tag it 'reveal' and store " \
        "it without outputs"
    assert "cell 9 is tagged 'reveal' but stores outputs (the answer)" in problems
    assert "cell 9 is tagged 'reveal' but not nbval-ignore-output" in problems
    assert problems[1].startswith("cell 9 answers the prediction asked in cell 8 in its stored")
    assert problems[4:] == [
        "no https link to a source (paper, Megatron-core file, seed document)",
        "no write-the-code exercise (a learner's function graded by grade(...))"]
    assert len(problems) == 6
    nb.cells.append(md("After [Shoeybi et al.](https://arxiv.org/abs/1909.08053)"))
    nb.cells.append(_executed("grade(my_f, exercises.tp_mappings.F, world)"))
    assert len(notebooks.lesson_problems(nb, "01")) == 4
    assert len(notebooks.lesson_problems(nb, "14")) == 4     # 11: no write-the-code required


def test_clean_clears_the_outputs_of_reveal_cells_only():
    nb = nbformat.v4.new_notebook()
    nb.cells = [_executed("print(1)", ["1"], tags=["reveal", "nbval-ignore-output"]),
                _executed("print(2)", ["2"])]
    notebooks.clean(nb)
    assert nb.cells[0].outputs == [] and nb.cells[0].execution_count == 1
    assert nb.cells[1].outputs[0].text == "2"


def test_clean_tags_and_empties_cells_that_call_reveal_but_not_the_one_defining_it():
    nb = nbformat.v4.new_notebook()
    nb.cells = [_executed("exercises.reveal(run.fault, run)", ["it was --inject-fault hang:1"]),
                _executed("def reveal(check, *args):\n    print(check)", ["x"]),
                _executed("x = 1  # reveal(later) is in a comment", ["y"])]
    notebooks.clean(nb)
    assert nb.cells[0].outputs == [] and nb.cells[0].execution_count == 1
    assert nb.cells[0].metadata.tags == ["reveal", "nbval-ignore-output"]
    assert notebooks.lesson_problems(nb) == []           # a reveal cell as the checker wants it
    assert [len(c.outputs) for c in nb.cells[1:]] == [1, 1]
    assert all("tags" not in c.metadata for c in nb.cells[1:])


def test_structure_checker_follows_anchors_into_other_notebooks(tmp_path):
    write_nb(tmp_path / "labs" / "01_x.ipynb", [nbformat.v4.new_markdown_cell("## 1. The part")])
    write_nb(tmp_path / "Start_Here.ipynb", [nbformat.v4.new_markdown_cell(
        "[ok](labs/01_x.ipynb#1.-The-part) [bad](labs/01_x.ipynb#2.-Nothing)")])
    problems = [p for p in notebooks.structure_problems(tmp_path) if p.startswith("Start_Here")]
    assert problems == ["Start_Here.ipynb: cell 0 links to missing labs/01_x.ipynb#2.-Nothing"]


def test_clean_strips_widget_state_and_timing_metadata():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.metadata.update(papermill={"duration": 1.0}, execution={"iopub.status.busy": "now"})
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        "text/plain": "interactive(...)", "application/vnd.jupyter.widget-view+json": {"model_id": "a"}})]
    nb.cells = [cell]
    nb.metadata.update(widgets={"state": {}}, papermill={"parameters": {}})
    notebooks.clean(nb)
    assert "widgets" not in nb.metadata and "papermill" not in nb.metadata
    assert nb.metadata.kernelspec["name"] == "python3"
    assert cell.metadata == {} and list(cell.outputs[0].data) == ["text/plain"]


def test_only_selects_by_number_or_stem():
    paths = notebooks.notebook_paths(REPO)
    assert [p.stem for p in notebooks.select(paths, ["01"])] == ["01_rank_groups"]
    assert [p.stem for p in notebooks.select(paths, ["Start_Here", "07_row_parallel"])] == \
        ["Start_Here", "07_row_parallel"]
    assert [p.stem for p in notebooks.select(paths, [6, "start"])] == ["Start_Here", "06_column_parallel"]
    with pytest.raises(SystemExit, match="matches no notebook"):
        notebooks.select(paths, ["42"])


def test_example_instructor_parameters_resolve_for_every_lab():
    params = notebooks.load_params(REPO / "labs" / "params_8gpu.yaml")
    paths = notebooks.notebook_paths(REPO)
    notebooks.check_param_sections(paths, params)
    got = {p.stem: notebooks.params_for(p, nbformat.read(p, 4), params) for p in paths}
    assert got["Start_Here"] == {}
    assert got["01_rank_groups"] == {"world_size": 8, "backend": "nccl", "tp": 4, "pp": 2}
    assert got["06_column_parallel"]["tp"] == 8 and got["08_tp_mappings"]["backend"] == "nccl"
    assert got["09_parallel_transformer"] == {"world_size": 8, "backend": "nccl", "tp": 4}
    assert got["14_train_gpt"]["tp_sizes"] == [1, 2, 4, 8] and got["14_train_gpt"]["heads"] == 8


def test_parameter_typos_are_refused(tmp_path):
    paths = notebooks.notebook_paths(REPO)
    lab = REPO / "labs" / "01_rank_groups.ipynb"
    with pytest.raises(SystemExit, match=r"\['tpp'\] not in its parameters cell"):
        notebooks.params_for(lab, nbformat.read(lab, 4), {"01": {"tpp": 4}})
    with pytest.raises(SystemExit, match="defined by no notebook"):
        notebooks.check_param_sections(paths, {"all": {"wrld_size": 8}})
    with pytest.raises(SystemExit, match="names no notebook"):
        notebooks.check_param_sections(paths, {"99_nothing": {"tp": 2}})


def test_regenerate_writes_back_only_what_ran_cleanly(tmp_path):
    good, bad = tmp_path / "good.ipynb", tmp_path / "bad.ipynb"
    write_nb(good, [nbformat.v4.new_code_cell("n = 2\nprint(n * 3)")])
    write_nb(bad, [nbformat.v4.new_code_cell("raise ValueError('boom')")])
    before = bad.read_bytes()
    log = io.StringIO()
    with pytest.raises(SystemExit, match="failed: bad.ipynb"):
        notebooks.regenerate([good, bad], out=log)
    assert bad.read_bytes() == before
    cell = nbformat.read(good, 4).cells[0]
    assert cell.execution_count == 1 and cell.outputs[0].text == "6\n"
    lines = log.getvalue().splitlines()
    assert "written" in lines[0] and "FAILED, not written" in lines[1] and "boom" in lines[1]
    assert lines[2].startswith("total") and "(1 written, 1 failed)" in lines[2]


def test_regenerate_command_line_help_documents_the_yaml_format():
    out = subprocess.run([sys.executable, "-m", "mpu_lab.labkit.notebooks", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "regenerate" in out and "figures" in out and "all:" in out


# --------------------------------------------------------------------------- nbval configuration
def test_sanitize_file_is_well_formed_and_normalises_machine_details():
    text = SANITIZE.read_text()
    pairs = re.findall(r"^regex: (.*)$\n^replace: (.*)$", text, flags=re.MULTILINE)
    assert len(pairs) == text.count("\nregex: ") + text.startswith("regex: ")
    assert all(replace.strip() for _, replace in pairs)      # a bare `replace:` is dropped

    def sanitize(s):
        for regex, replace in pairs:
            s = re.sub(regex, replace, s)
        return s

    assert sanitize("tensor([6.], device='cuda:2')") == sanitize("tensor([6.])") == "tensor([6.])"
    assert sanitize("at 0x7f3a9c2b1d30>") == "at 0xADDR>"
    assert sanitize("took 12.3 s") == "took TIME"
    assert sanitize("tcp://localhost:29500") == sanitize("tcp://127.0.0.1:41234")
    assert sanitize("backend nccl") == sanitize("backend gloo")
    assert sanitize("/tmp/mpu_lab_run_abc/logs, x") == "TMPPATH, x"


def test_pytest_runs_nbval_with_the_sanitize_file_and_the_stderr_plugin():
    import tomllib
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert {"tests", "Start_Here.ipynb", "labs"} <= set(config["testpaths"])
    for option in ("--nbval", "--nbval-current-env", "--nbval-sanitize-with tests/nbval_sanitize.cfg",
                   "-p mpu_lab.labkit.notebooks"):
        assert option in config["addopts"]


def test_nbval_plugin_ignores_stderr_but_still_compares_stdout(tmp_path):
    def notebook(name, stored_stdout):
        cell = nbformat.v4.new_code_cell("import sys\nprint('out')\nprint('warning', file=sys.stderr)")
        cell.execution_count = 1
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=stored_stdout),
                        nbformat.v4.new_output("stream", name="stderr", text="an older warning\n")]
        write_nb(tmp_path / name, [cell])

    (tmp_path / "pytest.ini").write_text("[pytest]\n")    # keep this repo's addopts out
    notebook("stderr_differs.ipynb", "out\n")
    notebook("stdout_differs.ipynb", "something else\n")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(tmp_path / "pytest.ini"),
         "--rootdir", str(tmp_path), "--nbval", "--nbval-current-env", "-p", "mpu_lab.labkit.notebooks",
         str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert "1 failed, 1 passed" in run.stdout, run.stdout[-2000:]
    assert "stdout_differs.ipynb::Cell 0" in run.stdout
