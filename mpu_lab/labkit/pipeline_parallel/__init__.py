"""Lab 11, pipeline parallelism: the bubble and 1F1B to write (``exercises``), Gantt charts
(``viz``), the measured bubble's verdict (``lessons``), and Megatron-core's schedules beside
mpu_lab's (``megatron_core``).
"""
