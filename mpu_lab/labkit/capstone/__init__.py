"""The capstone lab (issue 38 in the design): the learner's own Megatron pieces train a GPT,
step for step equal to the mirror's.

``python -m mpu_lab.labkit.capstone --code labs/solutions --tensor-model-parallel-size 2
--pipeline-model-parallel-size 2`` (or :func:`run_capstone` from a notebook) runs
``launch/capstone.py`` under torchrun. A learner's package is a folder of modules under these
names (``labs/solutions/`` is a finished one); each piece found replaces the mirror's, the
others are the mirror's:

=================================  ====================================================
``mappings.py``                    f, g, scatter / gather, the sequence-parallel three
``layers.py``                      ``ColumnParallelLinear``, ``RowParallelLinear``,
                                   ``VocabParallelEmbedding``
``cross_entropy.py``               ``vocab_parallel_cross_entropy``
``random.py``                      ``checkpoint`` (with the RNG save and restore)
``schedules.py``                   ``forward_backward_pipelining_without_interleaving``
``distributed_data_parallel.py``   ``DistributedDataParallel`` (buckets, hooks, async)
``distrib_optimizer.py``           ``DistributedOptimizer`` (reduce-scatter, step, all-gather)
=================================  ====================================================

The linear layers enter through Megatron-core's layer spec
(:func:`~mpu_lab.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec`); the others as
explicit arguments of the job's model building and training step (Megatron has no seam there).

Lab 18 (``labs/18_your_megatron.ipynb``) runs it: :mod:`~mpu_lab.labkit.capstone.lesson` surveys
the learner's folder (which lab builds each piece), writes a piece broken on purpose and says a
run's outcome; :mod:`~mpu_lab.labkit.capstone.exercises` holds the lab's questions.
"""
from mpu_lab.labkit.capstone.args import build_parser, check_args, parse_args
from mpu_lab.labkit.capstone.run import CapstoneResult, run_capstone

__all__ = ["CapstoneResult", "run_capstone", "build_parser", "check_args", "parse_args"]
