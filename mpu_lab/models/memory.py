"""Temporary alias: activation memory moved to :mod:`mpu_lab.perf.activation_memory` (the
measurement) and :mod:`mpu_lab.perf.cost_model.activations` (Korthikanti et al. 2022's terms and
their sum). Every name this module had is re-exported here until the callers are updated."""
from mpu_lab.perf.activation_memory import (  # noqa: F401
    BOOKKEEPING, CATEGORIES, MASKS, REPLICATED, SCORES, SPLIT, SavedTensors, Term, compare,
    config_name, format_comparison, format_terms, layer_activation_terms,
    measure_layer_activation_bytes, measured_row, mpu_lab_terms, paper_terms, ratios, total)
from mpu_lab.perf.cost_model.activations import _div  # noqa: F401
