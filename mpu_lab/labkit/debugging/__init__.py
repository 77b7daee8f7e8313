"""Lab 17, debugging: the broken jobs (``broken_jobs``: ``launch/train_gpt.py`` with a fault of
:mod:`mpu_lab.training.faults` each), the tools on a live world (``tools``: stacks of a hung
job, py-spy, the flight recorder), the check against the dense twin (``twin_check``) and the
checks (``exercises``).
"""
