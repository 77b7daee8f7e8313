"""What lab 18 shows around the capstone run: the learner's package surveyed piece by piece
(which lab builds each, which are in the folder), a piece broken on purpose in a folder of its
own, the run's outcome in words that do not change from one CPU to another, and the two loss
curves.

The pieces and their files are the ones ``launch/capstone.py`` reads (its ``PIECES``, in its
order; a test holds the two lists equal); a piece is *present* where the job would take it: from
its documented file, else from the one module of the folder that defines it at the top level.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import shutil
import textwrap
from typing import Dict, List, Optional

from matplotlib.ticker import MaxNLocator

from mpu_lab.labkit import REPO_ROOT, my_megatron, style
from mpu_lab.labkit.capstone.run import piece_lines, verdict
from mpu_lab.training.code_folder import defining_files, piece_source

SOLUTIONS = REPO_ROOT / "labs" / "solutions"
# the lab's broken package: under the git-ignored /runs/, rewritten by each run of the lab
BROKEN_DIR = REPO_ROOT / "runs" / "18_your_megatron" / "broken_megatron"

# (file, name, the lab whose exercise writes it), in launch/capstone.py's order
PIECES = (
    ("mappings.py", "copy_to_tensor_model_parallel_region", "08"),       # f
    ("mappings.py", "reduce_from_tensor_model_parallel_region", "08"),   # g
    ("mappings.py", "scatter_to_tensor_model_parallel_region", "08"),
    ("mappings.py", "gather_from_tensor_model_parallel_region", "08"),
    ("mappings.py", "scatter_to_sequence_parallel_region", "08"),
    ("mappings.py", "gather_from_sequence_parallel_region", "08"),
    ("mappings.py", "reduce_scatter_to_sequence_parallel_region", "08"),
    ("layers.py", "ColumnParallelLinear", "06"),
    ("layers.py", "RowParallelLinear", "07"),
    ("layers.py", "VocabParallelEmbedding", "09"),
    ("cross_entropy.py", "vocab_parallel_cross_entropy", "09"),
    ("random.py", "checkpoint", "03"),
    ("schedules.py", "forward_backward_pipelining_without_interleaving", "11"),
    ("distributed_data_parallel.py", "DistributedDataParallel", "04"),
    ("distrib_optimizer.py", "DistributedOptimizer", "04"),
)
# the capstone's tiny GPT: 2 layers per pipeline stage (launch/capstone.py's model_config)
LAYERS_PER_STAGE = 2


LAUNCH_SCRIPT = REPO_ROOT / "launch" / "capstone.py"


def model_shape(script=LAUNCH_SCRIPT) -> Dict[str, object]:
    """The capstone GPT's sizes as ``launch/capstone.py`` sets them (``HIDDEN, HEADS, ... =
    ...``), read from its source: a launch script is run, never imported."""
    for node in ast.parse(pathlib.Path(script).read_text()).body:
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
                and "HIDDEN" in [getattr(t, "id", None) for t in node.targets[0].elts]):
            names = [t.id for t in node.targets[0].elts]
            return dict(zip(names, ast.literal_eval(node.value)))
    raise ValueError(f"{script}: no 'HIDDEN, HEADS, ... = ...' line")


def print_model(pipeline_model_parallel_size: int) -> None:
    """One line: the capstone GPT at this pipeline size."""
    m = model_shape()
    print(f"capstone GPT: {LAYERS_PER_STAGE * pipeline_model_parallel_size} layers "
          f"({LAYERS_PER_STAGE} per stage), hidden size {m['HIDDEN']}, {m['HEADS']} heads, "
          f"sequence {m['SEQ']}, vocabulary {m['VOCAB']};\n{m['MICRO_BATCHES']} micro-batches "
          f"of {m['MICRO_BATCH']} sequences per iteration, Adam at learning rate {m['LR']:g}")


@dataclasses.dataclass(frozen=True)
class PieceRow:
    """One piece of the package: its documented ``file``, ``name``, the ``lab`` that builds
    it, and ``found_in``: the file of the folder it would be taken from (None: the mirror's)."""
    file: str
    name: str
    lab: str
    found_in: Optional[str]
    found_as: Optional[str] = None     # the name it is defined under (lab 11's my_1f1b_loop)


def survey(folder=None) -> List[PieceRow]:
    """Each piece the capstone knows, and where ``folder`` (default: the learner's package,
    :func:`mpu_lab.labkit.my_megatron.folder`) holds it. A missing folder holds nothing."""
    folder = my_megatron.folder(folder)
    defined = defining_files(folder) if folder.is_dir() else {}
    rows = []
    for file, name, lab in PIECES:
        source = piece_source(defined, file, name)
        rows.append(PieceRow(file, name, lab, *(source or (None, None))))
    return rows


def print_survey(folder=None) -> List[PieceRow]:
    """The survey as a table (lines within 100 characters), and one line that says what the
    run will use."""
    path = my_megatron.folder(folder)
    rows = survey(path)
    print(f"{'piece':<48} {'file':<28} {'lab':>3}  in {path.name}/")
    for r in rows:
        held = "-" if r.found_in is None else "yes" if r.found_in == r.file else r.found_in
        if r.found_as not in (None, r.name):
            held += f": {r.found_as}"      # within 100 characters
        print(f"{r.name:<48} {r.file:<28} {r.lab:>3}  {held}")
    have = sum(r.found_in is not None for r in rows)
    if not have:     # absent or empty alike: no exercise has saved into it yet
        print(f"{path.name}/ holds none of the {len(rows)} pieces yet: the run uses the "
              f"mirror's for every one.")
    else:
        print(f"{path.name}/ holds {have} of the {len(rows)} pieces; the run uses the mirror's "
              f"for the other {len(rows) - have}.")
    return rows


def package_folder(folder=None) -> pathlib.Path:
    """The learner's package folder, made (empty) where no exercise has saved into it yet: the
    capstone then uses the mirror's piece for every one."""
    path = my_megatron.folder(folder)
    path.mkdir(parents=True, exist_ok=True)
    return path


BROKEN_ROW = '''\
"""A RowParallelLinear broken on purpose (lab 18): each rank returns its own partial sum
X_r W_r^T; the all-reduce that adds the partial sums (g) is left out."""
import torch.nn.functional as F

from mpu_lab.core.tensor_parallel import RowParallelLinear as MirrorRowParallelLinear


class RowParallelLinear(MirrorRowParallelLinear):
    """The mirror's weights and arguments; only the forward is broken."""

    def forward(self, input_):
        partial = F.linear(input_, self.weight)        # [s, b, out]: this rank's share only
        if self.skip_bias_add:
            return partial, self.bias
        return (partial + self.bias if self.bias is not None else partial), None
'''


def write_broken_row_parallel(folder=BROKEN_DIR) -> pathlib.Path:
    """A package of one piece, broken: ``<folder>/layers.py`` whose ``RowParallelLinear``
    forgets g's all-reduce in its forward (the input is already split: the capstone's layer
    spec passes ``input_is_parallel=True``). Returns the file written."""
    folder = pathlib.Path(folder)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    path = folder / "layers.py"
    path.write_text(BROKEN_ROW)
    return path


def print_lines(result, missing: bool = True) -> None:
    """The capstone's lines (``missing:`` ones too when ``missing``), each wrapped within 100
    characters (the verdict is one long line)."""
    for line in result.lines:
        if missing or not line.startswith("missing:"):
            print(textwrap.fill(line, 100, subsequent_indent="    ", break_on_hyphens=False))


def print_outcome(result) -> None:
    """The run's outcome from its numbers, in words that do not depend on the CPU: the exit
    code, where the losses part (or that they do not) and the piece named."""
    if result.exit_code == 0:
        mine = sum(line.startswith("used:") for line in result.lines)
        print(textwrap.fill(
            f"exit code 0: the {len(result.learner_losses)} losses equal the mirror's" + (
                f", with {mine} of your pieces in the model" if mine else
                "; none of the pieces was yours, so both runs were the mirror's (a check of "
                "the capstone itself, not yet of your code)"), 100))
        return
    if result.first_parting is None:
        print("exit code 1: the job failed before the losses could be compared")
        return
    at, what = result.first_parting
    what = {"loss": "the loss", "grad_norm": "the gradient norm"}[what]
    print(f"exit code 1: {what} parts first, at iteration {at}; the piece named: "
          f"{result.culprit or 'none on its own'}")


@style.styled
def loss_figure(result, title: str = "your pieces over the mirror's"):
    """Your losses over the mirror's, one point per iteration (a Figure, no pyplot state)."""
    fig = style.new_figure(5, 3)
    ax = fig.subplots()
    steps = range(1, len(result.mirror_losses) + 1)
    ax.plot(steps, result.mirror_losses, "-", lw=5, alpha=0.35, label="the mirror's pieces")
    ax.plot(steps, result.learner_losses, "o--", label="your pieces")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="iteration", ylabel="loss", title=title)
    ax.legend()
    fig.tight_layout()
    return fig


def show_losses(result, title: str = "your pieces over the mirror's") -> None:
    """:func:`loss_figure` shown in the notebook."""
    style.display_figure(loss_figure(result, title))


def reference_args(tp: int, pp: int, train_iters: int) -> List[str]:
    """The flags of ``launch/capstone.py`` for the reference run (``--code labs/solutions``):
    what :func:`~mpu_lab.labkit.capstone.run_capstone` passes the job."""
    return ["--code", str(SOLUTIONS), "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--train-iters", str(train_iters)]


def backend_env(backend: str = "auto") -> Dict[str, str]:
    """The environment that makes the job's ranks use ``backend`` (none for ``"auto"``)."""
    return {} if backend == "auto" else {"MPU_LAB_BACKEND": backend}


def print_reference(result) -> None:
    """A finished job's per-piece lines and verdict (the ranks' reports turned into lines as
    the capstone does): ``used:`` lines only, and never a line of the solutions' code."""
    lines = piece_lines(result.results) + [verdict(result.results[0])[1]]
    print("\n".join(line for line in lines if not line.startswith("missing:")))
