"""Temporary alias: the cost model moved to :mod:`mpu_lab.perf.cost_model` (one module per topic:
``inputs``, ``activations``, ``counts``, ``predict``). Every name this module had, private ones
included, is re-exported here until the callers are updated."""
from mpu_lab.perf.cost_model import *  # noqa: F401,F403
from mpu_lab.perf.cost_model import __all__  # noqa: F401
from mpu_lab.perf.cost_model.counts import (  # noqa: F401
    BYTES_PER_PARAM_ADAM, _collectives_per_layer, _layer_activation_bytes, _score_bytes)
from mpu_lab.perf.cost_model.predict import (  # noqa: F401
    ADAM_STEP_BYTES_PER_PARAM, ELEMENTWISE_PASSES, _bandwidth, _collective_time,
    _dp_exposed_time)
