"""Where the write-the-code exercises keep their solutions, and the checks that keep them there.

A solution never runs on Run All (nor under papermill or nbval) and never takes the learner's
name: each lab's solutions live in ``labs/solutions/NN_topic.py``, which the learner loads on
purpose with ``%load solutions/NN_topic.py`` in a new cell, and each solution carries its own
name (``solution_column_forward``, not ``my_column_forward``), so loading it never replaces the
learner's function, and its verdict names the solution (``Right: solution_column_forward
agrees ...``), never the learner's function.

:data:`SOLUTIONS` lists, lab by lab, the file and the names: the learner's function (what the
notebook's stub defines) and the solution's. :func:`exercise_problems` finds what would spoil
an exercise in a stored notebook: a stored verdict of a solution (or of any function passing
under a learner's name: only a solution can have run there), a cell that defines a learner's
function with a body other than the stub, or a cell that defines a solution.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
from typing import Dict, List

from mpu_lab.labkit import REPO_ROOT

SOLUTIONS_DIR = REPO_ROOT / "labs" / "solutions"


@dataclasses.dataclass(frozen=True)
class Solution:
    """One lab's solution file (in ``labs/solutions/``) and its names: learner's -> solution's."""

    file: str
    names: Dict[str, str]

    @property
    def path(self) -> pathlib.Path:
        return SOLUTIONS_DIR / self.file

    @property
    def load_line(self) -> str:
        """What the learner types in a new cell (the labs run in ``labs/``)."""
        return f"%load solutions/{self.file}"


SOLUTIONS: Dict[str, Solution] = {
    "01": Solution("01_rank_groups.py", {"my_groups": "solution_groups"}),
    "02": Solution("02_collectives.py", {"my_ring_all_reduce": "solution_ring_all_reduce"}),
    "03": Solution("03_device_memory.py", {"my_checkpoint": "solution_checkpoint"}),
    "06": Solution("06_column_parallel.py", {"my_column_forward": "solution_column_forward",
                                             "MyColumnParallelLinear":
                                                 "SolutionColumnParallelLinear"}),
    "07": Solution("07_row_parallel.py", {"my_row_forward": "solution_row_forward",
                                          "MyRowParallelLinear": "SolutionRowParallelLinear"}),
    "08": Solution("08_tp_mappings.py", {
        "f_forward": "solution_f_forward", "f_backward": "solution_f_backward",
        "g_forward": "solution_g_forward", "g_backward": "solution_g_backward",
        **{f"my_{n}": f"solution_{n}" for n in (
            "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
            "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
            "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
            "reduce_scatter_to_sequence_parallel_region")}}),
    "09": Solution("09_parallel_transformer.py",
                   {"my_vocab_parallel_ce": "solution_vocab_parallel_ce",
                    "my_vocab_parallel_ce_backward": "solution_vocab_parallel_ce_backward",
                    "MyVocabParallelEmbedding": "SolutionVocabParallelEmbedding",
                    "my_vocab_parallel_cross_entropy": "solution_vocab_parallel_cross_entropy"}),
    "10": Solution("10_context_parallel.py", {"my_merge": "solution_merge",
                                              "my_zigzag": "solution_zigzag"}),
    "11": Solution("11_pipeline_parallel.py", {"my_1f1b_order": "solution_1f1b_order",
                                              "my_1f1b_loop": "solution_1f1b_loop"}),
    "12": Solution("12_zero_bubble.py", {"my_zbh1_order": "solution_zbh1_order"}),
    "13": Solution("13_mixture_of_experts.py", {"my_dispatch": "solution_dispatch"}),
    "17": Solution("17_debugging.py", {"my_exchange": "solution_exchange"}),
    "05": Solution("05_sharded_data_parallel.py", {"my_fully_shard": "solution_fully_shard",
                                                   "my_sharded_step": "solution_sharded_step"}),
    "04": Solution("04_data_parallel.py", {"my_grad_ready_hook": "solution_grad_ready_hook",
                                           "my_distributed_step": "solution_distributed_step",
                                           "MyDistributedDataParallel":
                                               "SolutionDistributedDataParallel",
                                           "MyDistributedOptimizer":
                                               "SolutionDistributedOptimizer"}),
}

LEARNER_NAMES = frozenset(n for s in SOLUTIONS.values() for n in s.names)
SOLUTION_NAMES = frozenset(n for s in SOLUTIONS.values() for n in s.names.values())
_EXERCISE_NAMES = "|".join(sorted(LEARNER_NAMES | SOLUTION_NAMES | {"f", "g", "solution_\\w+"}))
# A grader's "Right:" verdict of a write-the-code exercise (grader.grade prints it).
_VERDICT = re.compile(rf"\bRight: (?:{_EXERCISE_NAMES})\b.*\bagrees\b")


def solution_source(lab: str) -> str:
    """The text of lab ``lab``'s solution file ("06" -> labs/solutions/06_column_parallel.py)."""
    if lab not in SOLUTIONS:
        raise ValueError(f"lab {lab!r} has no solution file; labs with one: {sorted(SOLUTIONS)}")
    return SOLUTIONS[lab].path.read_text()


def _raises_not_implemented(fn: ast.FunctionDef) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name) and target.id == "NotImplementedError":
                return True
    return False


def _functions(source: str) -> List[ast.FunctionDef]:
    # IPython magics (%%ranks, %load, !cmd) are not Python: blank those lines before parsing
    lines = ["" if ln.lstrip().startswith(("%", "!")) else ln for ln in source.splitlines()]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return []
    return [n for n in ast.walk(tree)      # a class the learner writes (a whole layer) too
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def _output_text(out) -> str:
    text = out.get("text", "") or out.get("data", {}).get("text/plain", "")
    return "".join(text) if isinstance(text, list) else text


def exercise_problems(nb) -> List[str]:
    """What spoils a write-the-code exercise in a stored notebook ``nb`` (an nbformat node):
    a stored "Right: ... agrees" verdict of a function graded by ``grade`` (only a solution can
    have passed under Run All), a cell that defines a learner's function other than as the stub
    (a body that does not raise NotImplementedError replaces the learner's code on Run All), and
    a cell that defines a solution (solutions live in ``labs/solutions/``, loaded with %load)."""
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            if _VERDICT.search(_output_text(out)):
                problems.append(f"cell {i} stores a grader's 'Right:' verdict (a solution ran on "
                                f"Run All): keep solutions in labs/solutions/, loaded with %load")
                break
        for fn in _functions(cell.source):
            if fn.name in LEARNER_NAMES and not _raises_not_implemented(fn):
                problems.append(f"cell {i} defines the learner's {fn.name} with a body (a "
                                f"solution under the learner's name): the notebook holds only "
                                f"the stub, which raises NotImplementedError")
            if fn.name in SOLUTION_NAMES or fn.name.startswith("solution_"):
                problems.append(f"cell {i} defines {fn.name}: a solution runs on Run All there; "
                                f"keep it in labs/solutions/, loaded with %load")
    return problems
