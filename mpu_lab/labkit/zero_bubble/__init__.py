"""Lab 12, zero-bubble pipelines: the backward split into B and W on one layer (``split``), the
timelines of real runs and what each schedule holds (``timelines``, ``viz``), ZB-H1 against
1F1B timed on pinned cores (``timing``), and the ZB-H1 order to write (``exercises``).

Lab 11's pieces (its Gantt style, its bubble formulas) are imported from
:mod:`mpu_lab.labkit.pipeline_parallel`; the schedules themselves are the mirror's
(:mod:`mpu_lab.core.pipeline_parallel.action_lists`, ``schedule_runtime``).
"""
