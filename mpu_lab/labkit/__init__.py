"""The lab kit: what the Jupyter labs use on top of the Megatron mirror, one package per lab.

The rest of :mod:`mpu_lab` mirrors Megatron-LM (``core``, ``training``) or measures it
(``perf``) and never imports from here; the lab kit may import anything of it. A learner who
opens lab NN finds all of its support in the package of the same topic:

==  =======================  ==========================================================
01  ``rank_groups``          exercises, viz, megatron_core
02  ``collectives``          lessons, exercises
03  ``data_parallel``        lessons, exercises, viz, megatron_core
04  ``column_parallel``      exercises, viz (column and row splits, f and g), megatron_core
05  ``row_parallel``         exercises
06  ``tp_mappings``          exercises, viz (collectives before and after, job logs)
07  ``parallel_transformer`` exercises, viz
08  ``context_parallel``     lessons, exercises, viz
09  ``pipeline_parallel``    exercises, viz, megatron_core
10  ``mixture_of_experts``   lessons, exercises, viz, megatron_core
11  ``train_gpt``            runs (``launch/train_gpt.py`` jobs), lessons, exercises, viz
12  ``performance``          exercises, viz
13  ``scaling``              exercises, viz
14  ``debugging``            broken_jobs, tools, twin_check, exercises
==  =======================  ==========================================================

In each: ``lessons`` the drivers and printed lessons, ``exercises`` the ``check_*`` functions
and the write-the-code exercises, ``viz`` the pictures, ``megatron_core`` the lab's
side-by-side with Megatron-core (its rank side runs in :mod:`mpu_lab.megatron_reference`).
A later lab that reuses an earlier one's piece imports it from that lab's package.

What every lab shares sits at the top:

* :mod:`~mpu_lab.labkit.grader` — ``grade``: a write-the-code exercise run on a live world;
* :mod:`~mpu_lab.labkit.verdict` — the :class:`~mpu_lab.labkit.verdict.Verdict` every check
  returns, its printed line, the parsing of a learner's answer;
* :mod:`~mpu_lab.labkit.c10d_calls` — what a learner's function asked of ``torch.distributed``
  (torch's ``CommDebugMode``, through :mod:`mpu_lab.perf.comm_counts`);
* :mod:`~mpu_lab.labkit.style` — the plot style and colours every picture shares;
  :mod:`~mpu_lab.labkit.figures` — the catalogue of ``figures/`` and byte-stable PNGs;
* :mod:`~mpu_lab.labkit.profiles` — the machine profiles (laptop CPU, one GPU, 8 GPUs);
* :mod:`~mpu_lab.labkit.playground` — a live multi-rank world for notebook cells (``%%ranks``);
* :mod:`~mpu_lab.labkit.notebooks` — instructor tooling: regenerate, check, the nbval plugin;
* :mod:`~mpu_lab.labkit.capstone` — the capstone: a learner's own package run against the mirror.

Importing this package imports none of them.
"""
import pathlib

# The checkout: mpu_lab/labkit/__init__.py -> mpu_lab/labkit -> mpu_lab -> the repository.
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
