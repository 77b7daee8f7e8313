"""Temporary alias: the measurement tools moved to one module per topic —
:mod:`mpu_lab.perf.bandwidth` (nccl-tests' algbw/busbw), :mod:`mpu_lab.perf.breakdown` (where a
step's time goes), :mod:`mpu_lab.perf.utilisation` (how busy each rank is) and
:mod:`mpu_lab.perf.runs` (a profiled run next to the cost model); the step timer and its
categories are in :mod:`mpu_lab.timers`. Every name this module had, private ones included,
is re-exported here until the callers are updated."""
from mpu_lab.perf.bandwidth import (  # noqa: F401
    _BUS_FACTORS, _UNITS, COLLECTIVES, GLOO_REDUCE_SCATTER_NOTE, _check_op, _human_bytes,
    algbw, allreduce_fit, best_busbw, bus_factor, busbw, collective_numel, format_bandwidth,
    message_sizes, parse_size)
from mpu_lab.perf.breakdown import (  # noqa: F401
    breakdowns, categories, format_breakdown, training_window)
from mpu_lab.perf.runs import (  # noqa: F401
    _MODEL_TO_MEASURED, ProfiledRun, compare_with_model, format_measured_vs_predicted,
    format_utilisation, measured_vs_predicted, profile_training, training_flags)
from mpu_lab.perf.utilisation import (  # noqa: F401
    Utilisation, UtilisationSampler, _worker_rank, run_with_utilisation, schedule_utilisation)
from mpu_lab.timers import (  # noqa: F401
    CATEGORY_ORDER, COMPUTE, OTHER, WAIT, StepTimer, categorize)
