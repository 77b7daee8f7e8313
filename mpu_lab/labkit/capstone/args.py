"""The capstone's flags and the checks run before any process starts
(``python -m mpu_lab.labkit.capstone``): one message naming the flags, their values and what
would be valid (:class:`~mpu_lab.training.flag_errors.FlagError`)."""
from __future__ import annotations

import argparse
import ast
import pathlib
from typing import Dict, List, Optional, Sequence

from mpu_lab.launcher.runner import max_ranks
from mpu_lab.training.flag_errors import FlagError

# the tiny GPT of launch/capstone.py has 4 attention heads: t must divide them
HEADS = 4
MIN_ITERS, MAX_ITERS = 2, 50
# a learner's package defines each of these classes in one file (issue 38)
ONE_FILE_CLASSES = ("ColumnParallelLinear", "RowParallelLinear")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mpu_lab.labkit.capstone",
        description="Train a tiny GPT with your own Megatron pieces and with the mirror's, "
                    "from the same seed, and compare the losses iteration by iteration.")
    p.add_argument("--code", required=True, help="your package: a folder of modules "
                   "(layers.py, mappings.py, ...); labs/solutions is the reference")
    p.add_argument("--tensor-model-parallel-size", type=int, default=2)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--train-iters", type=int, default=3)
    p.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallelism: the sequence-parallel gather and reduce-scatter "
                        "take the place of f and g")
    p.add_argument("--plot", default=None, help="save the loss curves to this file (PNG)")
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="largest relative difference of a loss still called equal")
    return p


def class_definitions(folder: pathlib.Path) -> Dict[str, List[str]]:
    """``{class name: [files]}`` of the classes defined at the top level of ``folder``'s
    modules; ``FlagError`` for a file Python cannot parse."""
    found: Dict[str, List[str]] = {}
    for path in sorted(folder.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except SyntaxError as e:
            raise FlagError(f"--code {folder}: {path.name} line {e.lineno} is not valid Python "
                            f"({e.msg}); fix it or move it out of the folder") from None
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(path.name)
    return found


def check_args(a: argparse.Namespace) -> argparse.Namespace:
    """``a`` if the run can start, else ``FlagError`` (before any process starts)."""
    folder = pathlib.Path(a.code)
    if not folder.is_dir():
        raise FlagError(f"--code {a.code}: no such folder; give the folder of your modules "
                        f"(the reference is labs/solutions)")
    definitions = class_definitions(folder)
    for name in ONE_FILE_CLASSES:
        files = definitions.get(name, [])
        if len(files) > 1:
            raise FlagError(f"--code {a.code}: class {name} is defined in {len(files)} files "
                            f"({', '.join(files)}); a package defines it once: keep the one in "
                            f"layers.py (or in one file of your choice) and remove the others")
    sizes = {"--tensor-model-parallel-size": a.tensor_model_parallel_size,
             "--pipeline-model-parallel-size": a.pipeline_model_parallel_size,
             "--data-parallel-size": a.data_parallel_size}
    for flag, value in sizes.items():
        if value < 1:
            raise FlagError(f"{flag} {value}: a parallel size is at least 1", {flag: [1, 2]})
    if HEADS % a.tensor_model_parallel_size:
        raise FlagError(f"--tensor-model-parallel-size {a.tensor_model_parallel_size} does not "
                        f"divide the capstone GPT's {HEADS} attention heads",
                        {"--tensor-model-parallel-size": [t for t in (1, 2, 4)]})
    world = a.tensor_model_parallel_size * a.pipeline_model_parallel_size * a.data_parallel_size
    if world > max_ranks():
        raise FlagError(f"--tensor-model-parallel-size {a.tensor_model_parallel_size} x "
                        f"--pipeline-model-parallel-size {a.pipeline_model_parallel_size} x "
                        f"--data-parallel-size {a.data_parallel_size} = {world} ranks, more "
                        f"than this machine starts ({max_ranks()}); lower one of them")
    if not MIN_ITERS <= a.train_iters <= MAX_ITERS:
        raise FlagError(f"--train-iters {a.train_iters}: use {MIN_ITERS} to {MAX_ITERS} (a "
                        f"piece broken in its backward only changes the loss from the second "
                        f"iteration on)", {"--train-iters": [3]})
    if a.sequence_parallel and a.tensor_model_parallel_size == 1:
        raise FlagError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits "
                        "the sequence over the tensor-parallel ranks)",
                        {"--tensor-model-parallel-size": [2], "--sequence-parallel": [False]})
    if not 0 < a.tolerance < 1:
        raise FlagError(f"--tolerance {a.tolerance}: a relative difference between 0 and 1",
                        {"--tolerance": [1e-5]})
    return a


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check; ``FlagError`` for a run that cannot work."""
    return check_args(build_parser().parse_args(argv))
