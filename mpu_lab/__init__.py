"""mpu_lab: Megatron-LM's model-parallel unit (MPU), small enough to read and run anywhere.

Four parts (``docs/ARCHITECTURE.md`` draws the layers):

* ``core``: the Megatron mirror, at Megatron-core's own paths (``core/tensor_parallel/``,
  ``core/transformer/``, ``core/models/gpt/``, ``core/pipeline_parallel/``, ...), so a learner
  can open the real file beside ours; ``training``: Megatron-LM's ``megatron/training/``
  (arguments, initialisation, the loop, checkpointing);
* ``launcher``: a ``launch/`` script under torchrun from a notebook or a test;
* ``perf``: the cost model and the measurements, made from outside the mirror;
* ``labkit``: lessons, exercises and graders, pictures, the live playground and notebook
  tooling for the labs.
"""
__version__ = "0.1.0"
