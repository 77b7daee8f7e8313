"""Megatron's data parallelism (mpu_lab.training.initialize) and distributed optimizer
(mpu_lab.core.optimizer.DistributedOptimizer): the bucket layout worked by hand; in the shared
4-rank job (tests/mp/dp_checks.py), losses and gradient norms equal to the plain path's
(torch DDP or the explicit all-reduce, and AdamW: itself checked against the dense twin in
tests/models/test_gpt_mp.py) at DP = 4 and at DP = 2 with TP + SP or PP; optimizer states 1/d per
rank; buckets started during backward only with --overlap-grad-reduce; checkpoints across DP
sizes and optimizers; the flags' checks."""
import pytest
import torch

from mpu_lab import training
from mpu_lab.core.distributed.param_and_grad_buffer import ParamAndGradBuffer
from mp_reports import rel_diff

RTOL = 1e-5
LAYOUTS = ["dp4", "tp2_sp_dp2", "pp2_dp2"]
MODES = ["overlap", "distributed", "distributed_overlap"]


@pytest.fixture(scope="module")
def reports(four_rank_job):
    return [rep["dp"] for rep in four_rank_job[0]]


# ------------------------------------------------------------------ the buffer, by hand
def test_buffer_lays_out_parameters_in_reverse_into_padded_buckets():
    a, b, c = (torch.nn.Parameter(torch.full((n,), float(n))) for n in (3, 5, 6))
    buf = ParamAndGradBuffer([a, b, c], data_parallel_size=4, bucket_size=6)
    # reverse order: c (6) fills bucket 0; b (5) then a (3) make 8 >= 6 in bucket 1
    assert [[p.numel() for p in bk.params] for bk in buf.buckets] == [[6], [5, 3]]
    assert [(bk.offset, bk.numel_unpadded, bk.numel) for bk in buf.buckets] == [(0, 6, 8),
                                                                               (8, 8, 8)]
    assert (buf.numel, buf.numel_unpadded) == (16, 14)
    assert buf.param_range(c) == (0, 0, 6)
    assert buf.param_range(b) == (1, 8, 13)
    assert buf.param_range(a) == (1, 13, 16)
    # the values moved into the buffer; the parameters are views of it
    assert buf.param_data.tolist() == [6.0] * 6 + [0.0] * 2 + [5.0] * 5 + [3.0] * 3
    buf.param_data[8] = -1.0
    assert b[0].item() == -1.0
    buf.grad_data[13:16] = 7.0
    assert a.main_grad.tolist() == [7.0] * 3
    # 4 equal contiguous shards of each bucket
    assert [buf.buckets[0].shard_range(r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_late_parameters_get_buckets_of_their_own_at_the_end():
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (2, 3, 4))
    buf = ParamAndGradBuffer([a, b, c], data_parallel_size=2, bucket_size=None, late_params=[b])
    assert [([p.numel() for p in bk.params], bk.late) for bk in buf.buckets] == \
        [([4, 2], False), ([3], True)]
    assert buf.buckets[1].numel == 4                        # 3 padded to a multiple of 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(bucket_size=0), "bucket_size must be a positive"),
    (dict(data_parallel_size=0), "data_parallel_size must be >= 1"),
])
def test_buffer_refuses_bad_sizes(kwargs, message):
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=message):
        ParamAndGradBuffer(params, **{"data_parallel_size": 2, **kwargs})


def test_buffer_refuses_half_precision_parameters():
    with pytest.raises(ValueError, match=r"fp32 parameters on one device; got dtypes "
                                         r"\['torch.float16'\]"):
        ParamAndGradBuffer([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))], 2)


# ------------------------------------------------------------------ the flags
@pytest.mark.parametrize("flags, message", [
    (["--ddp-bucket-size", "0", "--use-distributed-optimizer"],
     "--ddp-bucket-size must be a positive number of elements, got 0"),
    (["--ddp-bucket-size", "1000"], "add one of them"),
])
def test_bad_data_parallel_flags_are_refused_before_launch(flags, message):
    with pytest.raises(ValueError, match=message):
        training.validate_args(training.parse_args(flags), 4)


# ------------------------------------------------------------------ live, 4 ranks
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_losses_and_norms_equal_the_plain_optimizer(reports, layout, mode):
    for rep in reports:
        plain, other = rep[layout]["plain"], rep[layout][mode]
        assert rel_diff(other["losses"], plain["losses"]) < RTOL
        assert rel_diff(other["grad_norms"], plain["grad_norms"]) < RTOL


@pytest.mark.parametrize("layout, d", [("dp4", 4), ("tp2_sp_dp2", 2), ("pp2_dp2", 2)])
def test_distributed_optimizer_keeps_one_dth_of_the_adam_states(reports, layout, d):
    for rep in reports:
        plain, sharded = rep[layout]["plain"], rep[layout]["distributed"]
        assert sharded["data_parallel_size"] == d
        n = plain["params"]
        # AdamW: exp_avg and exp_avg_sq, 4 bytes each per element, plus a 4-byte step
        # counter per tensor it updates (a parameter, or a parameter's shard)
        assert plain["optimizer_state_bytes"] == 8 * n + 4 * plain["optimizer_state_entries"]
        owned = (sharded["optimizer_state_bytes"] - 4 * sharded["optimizer_state_entries"]) / 8
        padding = sum(b["padded"] - b["numel"] for b in sharded["buckets"])
        assert abs(owned - n / d) <= padding, (owned, n, d, padding)
    # the shards of a data-parallel group cover each parameter exactly once: over the whole
    # world the owned elements add up to the parameters held, divided by d
    owned = sum((rep[layout]["distributed"]["optimizer_state_bytes"]
                 - 4 * rep[layout]["distributed"]["optimizer_state_entries"]) / 8
                for rep in reports)
    assert owned == sum(rep[layout]["plain"]["params"] for rep in reports) / d


@pytest.mark.parametrize("layout", LAYOUTS)
def test_buckets_start_during_backward_only_with_overlap(reports, layout):
    for rep in reports:
        for mode, kind in [("overlap", "all_reduce"), ("distributed", "reduce_scatter"),
                           ("distributed_overlap", "reduce_scatter")]:
            row = rep[layout][mode]
            late = {b["bucket"] for b in row["buckets"] if b["late"]}
            log = row["sync_log"]
            assert sorted(e["bucket"] for e in log) == [b["bucket"] for b in row["buckets"]]
            assert {e["kind"] for e in log} == {kind}
            for e in log:
                overlap = "overlap" in mode and e["bucket"] not in late
                assert e["started_in_backward"] is overlap, (mode, e)


def test_a_distributed_optimizer_checkpoint_resumes_at_other_dp_sizes_and_optimizers(reports):
    for rep in reports:
        want = rep["uninterrupted"]
        for name in ("tp2_dp2_distributed", "dp4_plain", "dp4_distributed"):
            got = rep[f"resumed_{name}"]
            assert got["iteration"] == 3
            assert rel_diff(got["losses"], want) < RTOL, name
