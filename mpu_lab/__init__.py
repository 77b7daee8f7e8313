"""mpu_lab: Megatron-LM's model-parallel unit (MPU), small enough to read and run anywhere.

Five parts (``docs/ARCHITECTURE.md`` draws the layers):

* ``core``: the Megatron mirror, at Megatron-core's own paths (``core/tensor_parallel/``,
  ``core/transformer/``, ``core/models/gpt/``, ``core/pipeline_parallel/``, ...), so a learner
  can open the real file beside ours; ``training``: Megatron-LM's ``megatron/training/``
  (arguments, initialisation, the loop, checkpointing);
* ``launcher``: a ``launch/`` script under torchrun from a notebook or a test;
* ``perf``: the cost model and the measurements, made from outside the mirror;
* ``megatron_reference``: Megatron's own code (Megatron-core, where installed) and tests, run
  beside the mirror in a ``launch/`` script's ranks;
* ``labkit``: one package per lab (its lessons, exercises and graders, pictures, Megatron-core
  side by side), and what the labs share: the grader, the live playground, the plot style,
  notebook tooling.
"""
__version__ = "0.1.0"
