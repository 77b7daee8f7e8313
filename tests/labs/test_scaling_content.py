"""Lab 16's prose states verdicts in words (which dimension is compute- or communication-bound on
which link, which cp and ep the explorer ranks first); these tests tie each sentence to the
numbers the lab prints, so a change of a preset or a formula that turns one fails here."""
import dataclasses

import pytest

from mpu_lab import perf
from mpu_lab.perf import back_of_envelope as be
from mpu_lab.perf import explorer

H100 = perf.DGX_H100
NVLINK, IB = H100.intra_node_bandwidth, H100.inter_node_bandwidth
GPT3 = dataclasses.replace(perf.GPT3_175B, vocab_size=51200)
MIX = perf.MIXTRAL_8X7B


def bounds(traffic):
    return traffic.bound(H100.peak_flops, NVLINK), traffic.bound(H100.peak_flops, IB)


C, M = "compute-bound", "communication-bound"


def test_section_2_verdicts_as_the_prose_reads_them():
    assert bounds(be.tensor_parallel(GPT3.h, GPT3.s, 8)) == (C, M)
    assert bounds(be.tensor_parallel(GPT3.h, GPT3.s, 32)) == (M, M)
    assert bounds(be.data_parallel(perf.parameter_count(GPT3) / 64, 1536 * GPT3.s // 2, 2)) \
        == (C, C)
    assert bounds(be.pipeline_parallel(GPT3.h, GPT3.s, 12, 8)) == (C, C)
    assert bounds(be.context_parallel(GPT3.h, 32768, 1, 4, 8)) == (C, M)
    for e in (2, 4, 8):
        assert bounds(be.expert_parallel(MIX.h, MIX.s, MIX.ffn, MIX.k, e)) == (C, C)


def test_the_matmul_sentence_large_batches_right_of_the_ridge_one_token_left():
    r = be.ridge(H100.peak_flops, H100.hbm_bandwidth)
    assert be.matmul_intensity(1, GPT3.h, GPT3.h) < r < be.matmul_intensity(GPT3.s, GPT3.h,
                                                                             GPT3.h)


def test_section_3_cp_buys_memory_and_its_ring_does_not_hide_over_infiniband():
    # Going further A asks at 64k tokens (lab 10 showed the 32k ranking: not the same answer)
    long = explorer.long_sequence_example(seq_length=65536)
    smallest = min(cp for cp, v in long["verdict"].items() if v == "fits")
    assert smallest != min(cp for cp, v in explorer.long_sequence_example()["verdict"].items()
                           if v == "fits")
    assert long["ranking"][0].cp == smallest                   # "ranks the smallest c first"
    assert be.context_parallel(GPT3.h, 65536, 1, smallest, 8).bound(H100.peak_flops, IB) == M
    # the activations the prediction cell prints are the same for every p at c = 1
    acts = set()
    for p in (1, 4, 16):
        cfg = perf.ParallelConfig(tp=8, pp=p, dp=64 // p, micro_batch_size=1,
                                  global_batch_size=64, sequence_parallel=True,
                                  recompute="selective", distributed_optimizer=True)
        acts.add(round(perf.cp_memory_per_gpu(long["model"], cfg, 1)["activations"]))
    assert len(acts) == 1


def test_section_3_moe_the_fastest_use_the_largest_ep():
    moe = explorer.moe_example()
    top = [r for r in moe["ranking"] if r.fits][:5]
    assert {r.ep for r in top} == {MIX.E}


@pytest.mark.parametrize("t, inside", [(8, True), (16, False), (32, False)])
def test_the_tp_size_table_marks_sizes_beyond_a_node(t, inside):
    row = be.format_tp_sizes(GPT3.h, GPT3.s, (t,), H100).splitlines()[2]
    assert ("(> node)" in row) != inside
