"""Lab 06, column-parallel linear: the column-parallel forward to write and its checks
(``exercises``), weights cut by columns or by rows and ``f`` / ``g`` (``viz``, which lab 07
draws with too), and the table of Megatron-core's layers beside mpu_lab's (``megatron_core``,
labs 06-08).
"""
