"""TEMPORARY: moved to mpu_lab.labkit.playground (this name is that module); the integrator removes it."""
import sys, mpu_lab.labkit.playground; sys.modules[__name__] = mpu_lab.labkit.playground  # noqa: E401,E702
