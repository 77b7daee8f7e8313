"""Lab 04, data parallelism: the drivers and printed lessons (``lessons``), the distributed
optimizer's step and the bucket hook to write (``exercises``), the overlap timeline and the
memory per rank (``viz``), and Megatron-core's DDP and distributed optimizer beside mpu_lab's
(``megatron_core``).
"""
