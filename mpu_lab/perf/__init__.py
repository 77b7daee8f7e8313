"""Performance: the analytic cost model of model-parallel training and the tools that measure it.

- :mod:`mpu_lab.perf.model` — FLOPs, communication volume, pipeline bubble, memory per GPU.
- :mod:`mpu_lab.perf.explorer` — enumerate and rank (t, p, d, m) for a model on a cluster.
- :mod:`mpu_lab.perf.calibrate` — fit on published runs; calibrate and check on this machine.
- :mod:`mpu_lab.perf.measure` — step-time breakdown, collective bandwidth, utilisation sampling.
"""
from mpu_lab.perf.model import *  # noqa: F401,F403
from mpu_lab.perf.explorer import Exploration, diagnose, explore  # noqa: F401
from mpu_lab.perf.measure import (  # noqa: F401
    StepTimer, Utilisation, UtilisationSampler, algbw, bus_factor, busbw)
