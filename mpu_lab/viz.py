"""TEMPORARY: moved to mpu_lab.labkit.viz (this name is that module); the integrator removes it."""
import sys, mpu_lab.labkit.viz; sys.modules[__name__] = mpu_lab.labkit.viz  # noqa: E401,E702
