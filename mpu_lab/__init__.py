"""mpu_lab: Megatron-LM's model-parallel unit (MPU), small enough to read and run anywhere.

Modules mirror Megatron-core's names so a learner can jump to the real thing:
``parallel_state`` (rank groups), ``distributed`` (backend/device choice),
``tensor_parallel`` (f/g collectives, column/row-parallel layers, vocab-parallel pieces),
``launch`` (torchrun from a notebook).
"""
__version__ = "0.1.0"
