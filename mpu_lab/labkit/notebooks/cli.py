"""The command line, ``python -m mpu_lab.labkit.notebooks``: regenerate, figures, check,
gpu-check."""
from __future__ import annotations

import argparse
import pathlib

from mpu_lab.labkit import REPO_ROOT
from mpu_lab.labkit.notebooks import sizing
from mpu_lab.labkit.notebooks.gpu_check import DEFAULT_OUTPUT_DIR, PROFILES, gpu_check
from mpu_lab.labkit.notebooks.regenerate import regenerate
from mpu_lab.labkit.notebooks.selection import lab_paths, load_params, notebook_paths, select
from mpu_lab.labkit.notebooks.structure import structure_problems
from mpu_lab.labkit.notebooks.watchdog import DEFAULT_STALL_S, terminate_as_exit
from mpu_lab.labkit.figures import save_figures

USAGE = '''Instructor tooling for the lab notebooks: re-execute, draw the figures, check the structure.

    python -m mpu_lab.labkit.notebooks regenerate                      # every notebook
    python -m mpu_lab.labkit.notebooks regenerate --only 01 --only 06  # some of them
    python -m mpu_lab.labkit.notebooks regenerate --params labs/params_8gpu.yaml --output-dir /tmp/dgx
    python -m mpu_lab.labkit.notebooks regenerate --profile 1gpu --output-dir /tmp/1gpu
    python -m mpu_lab.labkit.notebooks figures     # figures/*.png, byte for byte
    python -m mpu_lab.labkit.notebooks check       # structure checks, no kernel
    python -m mpu_lab.labkit.notebooks gpu-check   # every lab at this machine's profile,
                                                   # then tokens/s, MFU, busbw: one table
    python -m mpu_lab.labkit.notebooks gpu-check --profile cpu --only 01 --output-dir /tmp/gc

``regenerate`` runs each notebook through papermill in the notebook's own folder (what
``papermill --cwd labs`` does, and what nbval does), with the ``python3`` kernel. A notebook is
written back only when every cell ran without error; the saved copy carries outputs and
execution counts but no widget state and no papermill timing metadata, so ``git diff`` shows
only what changed. It prints the time each notebook took.

Each notebook runs in a watched child process: when a cell is executing and, for ``--stall-s``
seconds, no output comes and the kernel with everything it started uses no CPU time (a reply
that never came), the whole process tree is killed and the notebook is run once more; it says
so and why. A long cell that keeps the CPU busy is left alone.

``gpu-check`` is the acceptance run on a GPU machine: every lab at the machine's profile
(``auto``: 8gpu with >= 8 GPUs, 1gpu with >= 1, else cpu; parameters from
``labs/profiles/<profile>.yaml``) written under ``--output-dir`` (never over the committed
notebooks), then ``launch/bench_gpt_vs_plain.py`` (GPT-2 small in bf16: tokens/s and MFU) and
``launch/bench_bandwidth.py`` (the best busbw per collective). It prints a table per lab (pass
or fail, seconds) and the benchmarks' figures, and writes it as markdown with the device name,
torch version and date to ``DIR/gpu_check.md``.

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
        description="Re-execute the lab notebooks, regenerate figures/, check notebook structure, "
                    "run the GPU acceptance check.",
        epilog=USAGE.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    reg = sub.add_parser("regenerate", help="re-execute notebooks with papermill and save them")
    reg.add_argument("--params", help="YAML file of parameters (see above)")
    reg.add_argument("--profile", help="machine profile for every lab: cpu, 1gpu, 8gpu or a YAML "
                                       "path (injects profile=NAME; --params values still win)")
    reg.add_argument("--only", action="append", help="notebook stem or number, e.g. 01 (repeatable)")
    reg.add_argument("--output-dir", help="write executed notebooks under this folder instead "
                                          "of in place (same relative paths)")
    reg.add_argument("--kernel", default="python3", help="Jupyter kernel (default %(default)s)")
    reg.add_argument("--cell-timeout", type=int, default=900,
                     help="seconds one cell may run (default %(default)s)")
    gpu = sub.add_parser("gpu-check", help="every lab at a GPU profile, then the benchmarks: "
                                           "one table (and DIR/gpu_check.md)")
    gpu.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR),
                     help="executed notebooks and gpu_check.md go here (default %(default)s)")
    gpu.add_argument("--profile", choices=("auto",) + PROFILES, default="auto",
                     help="machine profile (default %(default)s: from the GPUs seen)")
    gpu.add_argument("--only", action="append", help="lab stem or number (repeatable)")
    gpu.add_argument("--kernel", default="python3", help="Jupyter kernel (default %(default)s)")
    gpu.add_argument("--cell-timeout", type=int, default=900,
                     help="seconds one cell may run (default %(default)s)")
    gpu.add_argument("--bench-timeout", type=float, default=600,
                     help="seconds each benchmark may run (default %(default)s)")
    gpu.add_argument("--jobs", type=int, default=1,
                     help="labs run at once, sharing the GPUs (default %(default)s)")
    gpu.add_argument("--time-budget", type=float, default=None, metavar="S",
                     help="start no lab or benchmark after S seconds; the table says what "
                          "did not run (default: no limit)")
    for p in (reg, gpu):
        p.add_argument("--stall-s", type=float, default=DEFAULT_STALL_S,
                       help="kill and retry a notebook whose kernel, while a cell executes, "
                            "gives no output and uses no CPU for this long (default "
                            "%(default)s; 0: off)")
    fig = sub.add_parser("figures", help="regenerate figures/*.png deterministically")
    fig.add_argument("--out", default=str(REPO_ROOT / "figures"))
    sub.add_parser("check", help="structure checks (no kernel)")
    size = sub.add_parser("sizes", help="Start_Here's table of lab times (core and Going "
                                        "further), or one lab's sections with --sections")
    size.add_argument("--only", action="append", help="lab stem or number (repeatable)")
    size.add_argument("--sections", action="store_true",
                      help="minutes per section (reading, exercises, questions; no compute)")
    size.add_argument("--times", nargs="+", metavar="FILE",
                      help="learners' stopwatch files (~/.mpu_lab/lab_times.json each): "
                           "show the median minutes measured per lab")
    args = parser.parse_args(argv)

    if args.command == "regenerate":
        paths = select(notebook_paths(), args.only)
        params = load_params(args.params) if args.params else {}
        if args.profile:   # the labs' resolve cell fills what --params left None
            params.setdefault("all", {})["profile"] = args.profile
        with terminate_as_exit():   # a killed regeneration leaves no kernel or job behind
            regenerate(paths, params, output_dir=args.output_dir, kernel=args.kernel,
                       timeout_s=args.cell_timeout, stall_s=args.stall_s,
                       known=notebook_paths())
        return 0
    if args.command == "gpu-check":
        with terminate_as_exit():
            return gpu_check(args.output_dir, profile=args.profile, only=args.only,
                             stall_s=args.stall_s, cell_timeout=args.cell_timeout,
                             bench_timeout=args.bench_timeout, kernel=args.kernel,
                             jobs=args.jobs, time_budget_s=args.time_budget)
    if args.command == "sizes":
        labs = select(lab_paths(), args.only)
        if not args.sections:
            sizing.print_lab_sizes(labs, [pathlib.Path(t) for t in args.times or ()])
            return 0
        for path in labs:
            print(path.stem)
            for heading, minutes in sizing.section_minutes(path):
                print(f"  {minutes:5.1f} min  {heading}")
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
