"""Lab 13, mixture of experts: the lessons from the mirror's own pieces (``lessons``), the token
dispatch to write (``exercises``), routing, loads and capacity (``viz``), and Megatron-core's
``MoELayer`` beside mpu_lab's (``megatron_core``).
"""
