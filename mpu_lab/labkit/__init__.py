"""The lab kit: what the Jupyter labs use on top of the Megatron mirror.

The rest of :mod:`mpu_lab` mirrors Megatron-LM (``parallel_state``, ``tensor_parallel``,
``pipeline_parallel``, ...) and never imports from here; the lab kit may import anything of it.

* :mod:`~mpu_lab.labkit.viz` — the pictures, one module per lab topic;
* :mod:`~mpu_lab.labkit.exercises` — the labs' ``check_*`` functions, one module per lab;
* :mod:`~mpu_lab.labkit.playground` — a live multi-rank world for notebook cells (``%%ranks``);
* :mod:`~mpu_lab.labkit.notebooks` — instructor tooling: regenerate, check, the nbval plugin;
* :mod:`~mpu_lab.labkit.gpt_runs` — lab 11/12's ``launch/train_gpt.py`` jobs and their losses;
* :mod:`~mpu_lab.labkit.collective_layouts` — the layouts of Megatron's collective tests, shared
  with ``launch/collectives.py``.

Importing this package imports none of them (a torchrun worker reads the layouts for nothing).
"""
import pathlib

# The checkout: mpu_lab/labkit/__init__.py -> mpu_lab/labkit -> mpu_lab -> the repository.
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
