"""The command line, ``python -m mpu_lab.labkit.notebooks``: regenerate, figures, check."""
from __future__ import annotations

import argparse

from mpu_lab.labkit import REPO_ROOT
from mpu_lab.labkit.notebooks.regenerate import regenerate
from mpu_lab.labkit.notebooks.selection import load_params, notebook_paths, select
from mpu_lab.labkit.notebooks.structure import structure_problems
from mpu_lab.labkit.viz.figures import save_figures

USAGE = '''Instructor tooling for the lab notebooks: re-execute, draw the figures, check the structure.

    python -m mpu_lab.labkit.notebooks regenerate                      # every notebook
    python -m mpu_lab.labkit.notebooks regenerate --only 01 --only 04  # some of them
    python -m mpu_lab.labkit.notebooks regenerate --params labs/params_8gpu.yaml --output-dir /tmp/dgx
    python -m mpu_lab.labkit.notebooks figures     # figures/*.png, byte for byte
    python -m mpu_lab.labkit.notebooks check       # structure checks, no kernel

``regenerate`` runs each notebook through papermill in the notebook's own folder (what
``papermill --cwd labs`` does, and what nbval does), with the ``python3`` kernel. A notebook is
written back only when every cell ran without error; the saved copy carries outputs and
execution counts but no widget state and no papermill timing metadata, so ``git diff`` shows
only what changed. It prints the time each notebook took.

A parameters file is YAML::

    all:                 # offered to every notebook; each takes the names its `parameters` cell defines
      world_size: 8
      backend: nccl
    01_rank_groups:      # one notebook (file stem, or its number "01"); every name must exist there
      tp: 4

This package is also a pytest plugin (``-p mpu_lab.labkit.notebooks`` in ``pyproject.toml``):
it tells nbval not to compare ``stderr`` streams, which carry library warnings that change
between versions while the notebooks' results do not.
'''


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mpu_lab.labkit.notebooks",
        description="Re-execute the lab notebooks, regenerate figures/, check notebook structure.",
        epilog=USAGE.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    reg = sub.add_parser("regenerate", help="re-execute notebooks with papermill and save them")
    reg.add_argument("--params", help="YAML file of parameters (see above)")
    reg.add_argument("--only", action="append", help="notebook stem or number, e.g. 01 (repeatable)")
    reg.add_argument("--output-dir", help="write executed notebooks under this folder instead "
                                          "of in place (same relative paths)")
    reg.add_argument("--kernel", default="python3", help="Jupyter kernel (default %(default)s)")
    reg.add_argument("--cell-timeout", type=int, default=900,
                     help="seconds one cell may run (default %(default)s)")
    fig = sub.add_parser("figures", help="regenerate figures/*.png deterministically")
    fig.add_argument("--out", default=str(REPO_ROOT / "figures"))
    sub.add_parser("check", help="structure checks (no kernel)")
    args = parser.parse_args(argv)

    if args.command == "regenerate":
        paths = select(notebook_paths(), args.only)
        params = load_params(args.params) if args.params else {}
        regenerate(paths, params, output_dir=args.output_dir, kernel=args.kernel,
                   timeout_s=args.cell_timeout)
        return 0
    if args.command == "figures":
        for path in save_figures(args.out):
            print(path)
        return 0
    problems = structure_problems()
    for p in problems:
        print(p)
    print(f"{len(notebook_paths())} notebooks checked, {len(problems)} problems")
    return 1 if problems else 0
