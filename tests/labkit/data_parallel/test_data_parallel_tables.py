"""Lab 04's printed tables: Megatron-core's bytes per parameter against its distributed-optimizer
guide's table (docs/source/api-guide/dist_optimizer.md: 4 + 16/d, 6 + 12/d, 8 + 8/d), in lines
of at most 100 characters."""
from mpu_lab.labkit.data_parallel import lessons


def test_megatron_bytes_are_the_guides_rows_and_fit_100_characters():
    lines = lessons.format_megatron_bytes(4).splitlines()
    assert max(len(line) for line in lines) <= 100
    rows = {line[:11]: line.split()[-5:] for line in lines[3:]}
    # the guide: (plain = d of 1, kept + split/d), at d = 4 worked by hand
    assert rows["fp16 / fp16"] == ["20", "4", "+", "16/d", "8"]
    assert rows["bf16 / fp32"] == ["18", "6", "+", "12/d", "9"]
    assert rows["fp32 / fp32"] == ["16", "8", "+", "8/d", "10"]


def test_megatron_bytes_refuse_a_data_parallel_size_that_is_not_whole():
    import pytest
    with pytest.raises(ValueError, match="got 1.5"):
        lessons.format_megatron_bytes(1.5)
