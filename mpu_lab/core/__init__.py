"""The Megatron mirror: Megatron-core's algorithm at Megatron-core's own paths, so a learner can
open ``megatron/core/<path>`` beside ``mpu_lab/core/<path>`` (docs/ARCHITECTURE.md lists each
file and the file it mirrors). Nothing here observes, times, plots or injects faults: the lab
kit and ``mpu_lab.perf`` do that from outside.

* ``parallel_state`` (rank groups; the pure maths in ``parallel_state_groups``),
* ``tensor_parallel``, ``context_parallel``, ``pipeline_parallel``,
* ``transformer`` (layer, block, attention, MLP, ``moe/``), ``models/gpt``,
* ``distributed`` (Megatron's DDP and the gradient reductions), ``optimizer``,
* ``comm``, the one place collectives are called, and ``utils``.
"""
