"""The mirror's ``TransformerConfig`` accepts and refuses the recomputation fields as
Megatron-core's own does (whichever megatron-core this Python has; skipped where it cannot be
imported): the combinations lab 03 shows, and one that only the SP check sees."""
import warnings

import pytest

from mpu_lab.core.transformer import TransformerConfig
from mpu_lab.labkit.device_memory.lessons import FIELD_CASES
from mpu_lab.megatron_reference import runtime as mc

needs_megatron = pytest.mark.skipif(not mc.available(), reason=mc.missing() or "")
CASES = list(FIELD_CASES) + [
    dict(distribute_saved_activations=True, sequence_parallel=True),   # no granularity
    dict(recompute_granularity="selective", recompute_method="uniform"),
]


def _accepts(config_class, fields, **extra) -> bool:
    try:
        config_class(num_layers=4, hidden_size=64, num_attention_heads=4, **fields, **extra)
    except ValueError:
        return False
    return True


@needs_megatron
@pytest.mark.parametrize("fields", CASES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items())
                         or "none")
def test_recompute_fields_accepted_and_refused_as_megatron_core_does(fields):
    with mc.without_cuda_runtime_notice(), warnings.catch_warnings():
        warnings.simplefilter("ignore")     # megatron-core's import-time notices
        mc.import_megatron()
        from megatron.core.transformer.transformer_config import TransformerConfig as Megatron
        # Megatron-core also refuses sequence parallelism without tensor parallelism
        theirs = _accepts(Megatron, fields, tensor_model_parallel_size=2)
    assert _accepts(TransformerConfig, fields) == theirs
