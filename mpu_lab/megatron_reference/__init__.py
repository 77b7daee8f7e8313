"""Megatron's own code and tests, run beside the mirror: the reference a lab compares with.

Megatron-core itself (optional: where ``megatron-core`` is not installed every check says how
to add it) runs here, in the ranks of a ``launch/`` script, on the same world as mpu_lab:

* :mod:`~mpu_lab.megatron_reference.runtime` — importing Megatron-core, building its parallel
  state beside mpu_lab's, tearing both down;
* :mod:`~mpu_lab.megatron_reference.cpu` — the patches that let Megatron-core's CUDA-minded code
  run on a CPU under gloo, each with its reason: the one place in mpu_lab that rebinds a
  function at run time (of Megatron-core and torch, in the job's own processes; named by
  ``tests/test_no_rebinding.py``);
* :mod:`~mpu_lab.megatron_reference.layers`, ``ddp``, ``moe``, ``schedules`` — Megatron-core's
  tensor-parallel layers and mappings, DDP and distributed optimizer, ``MoELayer``, pipeline
  schedules next to mpu_lab's on the same weights (``launch/megatron_core_*.py``);
* :mod:`~mpu_lab.megatron_reference.collective_layouts` — the layouts of Megatron-LM's
  tensor-parallel unit tests (``launch/collectives.py``, lab 08).

It sits above ``perf``, ``training`` and the launcher and below the lab kit: a launch script
imports it, and each lab's ``megatron_core`` module (in :mod:`mpu_lab.labkit`) starts its job
and prints what the ranks report.
"""
