"""Lab 09's overlap verdict follows from the step times (worked by hand)."""
from mpu_lab.labkit.parallel_transformer import lessons


def _reports(pairs, device="cpu"):
    return [dict(rank=k, device=device,
                 modes=dict(overlap=dict(step_ms=o), serial=dict(step_ms=s)))
            for k, (o, s) in enumerate(pairs)]


def test_the_verdict_is_computed_from_the_printed_times():
    # 78 / 100 and 70 / 100: 22 % and 30 % saved, but 2 ranks on 2 cores: not the GPU's overlap
    line = lessons.overlap_verdict(_reports([(78, 100), (70, 100)]), cores=2)
    assert "every rank saved at least 22 % (+22 %, +30 %)" in line
    assert "not the GPU's overlap" in line
    line = lessons.overlap_verdict(_reports([(37, 41), (39.4, 38.7)]), cores=2)
    assert "a saving beyond 5 % on 1 of 2 ranks only (+10 %, -2 %): no clear saving" in line
    line = lessons.overlap_verdict(_reports([(110, 100), (120, 100)], device="cuda"), cores=2)
    assert line == ("Measured with 2 ranks on 2 cores:\nevery rank was slower overlapped "
                    "(-10 %, -20 %).")
    # the longest verdict a 2-rank run prints fits the notebooks' 100 characters per line
    line = lessons.overlap_verdict(_reports([(37, 41), (39.4, 38.7)]), cores=2)
    assert max(len(text) for text in line.splitlines()) <= 100, line


def test_the_split_table_marks_only_the_rows_tensor_parallelism_changed():
    """The lecture's tables at B=2, L=8, D=16, n_H=4: at d_tp = 2, Q is 2x8x8 (D/2) and Out
    stays 2x8x16; a report read back from JSON holds lists, the process's rows tuples."""
    from mpu_lab.perf.layer_shapes import shape_table
    dense = shape_table(2, 8, 16, 4, tensor_model_parallel_size=1)
    split = [dict(r, shape=list(r["shape"])) for r in dense]
    split[0] = dict(split[0], shape=[2, 8, 8])                      # Q cut by d_tp = 2
    lines = lessons.format_split_shapes(dense, split, 2).splitlines()
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows["Q"].endswith("*") and "2 x 8 x 8" in rows["Q"]
    assert not rows["Out"].endswith("*")


def test_the_sequence_parallel_reading_gives_the_papers_counts():
    """Korthikanti et al. 2022, §4.2.2, worked by hand for one layer (two column-parallel and two
    row-parallel linears): forward an all-gather per f and a reduce-scatter per g (2 + 2),
    backward the other way round plus the weight gradient's all-gather of each column-parallel
    layer's input (4 + 2); lines fit the notebook's 100 characters."""
    text = lessons.explain_sp_layer_collectives(tp=2)
    flat = " ".join(text.split())
    assert "2 all-gathers + 2 reduce-scatters, and backward" in flat
    assert "2 more all-gathers, one per column-parallel layer" in flat
    assert "4 all-gathers + 2 reduce-scatters backward" in flat
    assert max(len(line) for line in text.splitlines()) <= 100
