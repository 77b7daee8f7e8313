"""Lab 08, the tensor-parallel mappings: ``f`` and ``g`` to write and Megatron's collective tests
predicted (``exercises``), each rank's tensor before and after a collective and the collectives
job's logs (``viz``).
"""
