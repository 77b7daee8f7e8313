"""What the labs print, at parameters other than their CPU defaults: a cell is run on its own
with the names it needs, and its printout is compared with values worked by hand."""
import contextlib
import io
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_cell(notebook: str, marker: str, namespace: dict) -> str:
    """Execute the one code cell of ``labs/<notebook>`` whose source contains ``marker``."""
    nb = json.loads((ROOT / "labs" / notebook).read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code" and marker in "".join(c["source"])]
    assert len(cells) == 1, f"{len(cells)} cells of {notebook} contain {marker!r}"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec("".join(cells[0]["source"]), namespace)
    return out.getvalue()


def test_lab06_embedding_groups_at_dp_2_are_megatrons():
    """8 ranks, 4 stages: the pipelines are [0, 2, 4, 6] and [1, 3, 5, 7] (dp varies fastest
    after tp), so the embedding groups (first and last stage) are [0, 6] and [1, 7] — not the
    [0, 3] and [4, 7] of a "ranks d·pp .. d·pp + pp - 1" reading."""
    from mpu_lab.core.parallel_state import generate_rank_groups
    text = run_cell("11_pipeline_parallel.ipynb", 'groups["embedding"]',
                    dict(world_size=8, pp=4, generate_rank_groups=generate_rank_groups))
    assert text.splitlines() == ["pipeline [0, 2, 4, 6]: embedding group [0, 6]",
                                 "pipeline [1, 3, 5, 7]: embedding group [1, 7]"]
