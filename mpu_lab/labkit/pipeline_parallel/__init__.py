"""Lab 09, pipeline parallelism: the bubble and 1F1B to write (``exercises``), Gantt charts
(``viz``), and Megatron-core's schedules beside mpu_lab's (``megatron_core``).
"""
