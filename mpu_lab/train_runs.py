"""TEMPORARY: moved to mpu_lab.labkit.gpt_runs (this name is that module); the integrator removes it."""
import sys, mpu_lab.labkit.gpt_runs; sys.modules[__name__] = mpu_lab.labkit.gpt_runs  # noqa: E401,E702
