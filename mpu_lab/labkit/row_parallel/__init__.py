"""Lab 07, row-parallel linear: the row-parallel forward to write and its checks (``exercises``).
Its pictures and its Megatron-core table are lab 06's (:mod:`mpu_lab.labkit.column_parallel`).
"""
