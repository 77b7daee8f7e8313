"""mpu_lab: Megatron-LM's model-parallel unit (MPU), small enough to read and run anywhere.

Three parts (``docs/ARCHITECTURE.md`` draws the layers):

* the Megatron mirror, named after Megatron-core's files so a learner can jump to the real
  thing: ``parallel_state`` (rank groups), ``distributed`` (backend and device),
  ``comm`` (every collective), ``tensor_parallel``, ``models``, ``pipeline_parallel``,
  ``optimizer``, ``checkpointing``, ``training``;
* ``launcher``: a ``launch/`` script under torchrun from a notebook or a test;
* ``labkit``: pictures, exercises, the live playground and notebook tooling for the labs;

and ``perf``, the cost model and the measurement tools, between the mirror and the lab kit.
"""
__version__ = "0.1.0"
