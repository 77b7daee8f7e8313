"""Performance: the analytic cost model of model-parallel training and the tools that measure it.

- :mod:`mpu_lab.perf.cost_model` — FLOPs, communication volume, pipeline bubble, memory per GPU,
  time per iteration (Narayanan et al. 2021, Korthikanti et al. 2022); pure Python.
- :mod:`mpu_lab.perf.explorer` — enumerate and rank (t, p, d, m) for a model on a cluster.
- :mod:`mpu_lab.perf.published_runs` — fit on published runs and predict the others.
- :mod:`mpu_lab.perf.calibrate` — calibrate on this machine and check against real runs.
- :mod:`mpu_lab.perf.bandwidth` — collective bandwidth as nccl-tests reports it.
- :mod:`mpu_lab.perf.breakdown` — where a training step's time goes, per rank (``StepTimer``,
  a callback of the training loop, ``--breakdown``).
- :mod:`mpu_lab.perf.utilisation` — how busy each rank is over time.
- :mod:`mpu_lab.perf.runs` — a profiled training run next to the cost model's prediction.
- :mod:`mpu_lab.perf.saved_activations` — what one layer's autograd keeps, against the paper.
- :mod:`mpu_lab.perf.recompute` — the same per recomputation mode (none, selective, full),
  against the terms derived for the dtype and attention kernel run, and each mode's FLOPs
  counted with ``FlopCounterMode``.
- :mod:`mpu_lab.perf.pipeline_schedules` — idle unit slots per pipeline rank of each schedule
  (1F1B, interleaved, ZB-H1, ZBV), simulated from the orders the runtime executes.
- :mod:`mpu_lab.perf.comm_counts` — collectives per layer and pass, counted from outside the
  model with torch's ``CommDebugMode``.
- :mod:`mpu_lab.perf.comm_timing` — collectives timed from outside the mirror, through
  ``mpu_lab.core.comm``'s hook point.
"""
from mpu_lab.perf.cost_model import *  # noqa: F401,F403
from mpu_lab.perf.bandwidth import algbw, bus_factor, busbw  # noqa: F401
from mpu_lab.perf.explorer import Exploration, diagnose, explore  # noqa: F401
from mpu_lab.perf.utilisation import Utilisation, UtilisationSampler  # noqa: F401
from mpu_lab.perf.breakdown import StepTimer  # noqa: F401
