"""Megatron-FSDP's four sharding strategies (mpu_lab.core.distributed.fsdp) on real worlds:
two torchrun jobs of tests/mp/fsdp_checks.py (4 ranks, then 2 ranks loading the first one's
checkpoint). Each strategy against plain data parallelism (torch DDP and AdamW, held to the
dense twin in tests/models/test_gpt_mp.py): the losses of 3 steps and the parameters after them,
at DP = 4, DP = 2 and TP = 2 x DP = 2; rank 0's resident bytes at DP = 4 against numbers worked
by hand below; the bytes of a step seen by CommDebugMode against ZeRO's 2(d-1)/d Ψ and
3(d-1)/d Ψ; a ZeRO-3 checkpoint at DP = 4 resumed under no_shard at DP = 2."""
import collections
import pathlib

import pytest

from mpu_lab.launcher import run
from mpu_lab.perf.cost_model import data_parallel_bytes_per_step, ring_bytes
from mp_reports import rel_diff

pytestmark = pytest.mark.slow

WORKER = pathlib.Path(__file__).resolve().parents[2] / "mp" / "fsdp_checks.py"
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-6

# ------------------------------------------------------------------ the model, by hand
# L = 2 layers, h = 32, MLP width f = 129, vocabulary 128, 16 positions (TP = 1).
# One layer: 2 LayerNorms 2 x 64, qkv 32 x 96 + 96 = 3168, proj 32 x 32 + 32 = 1056,
# fc1 129 x 32 + 129 = 4257, fc2 32 x 129 + 32 = 4160: 12769 elements (= 1 mod 4).
LAYER = 64 + 3168 + 1056 + 64 + 4257 + 4160
ROOT = 128 * 32 + 16 * 32 + 64              # word + position embeddings, final LayerNorm: 4672
PSI = ROOT + 2 * LAYER                      # 30210 elements
TENSORS = 2 + 2 * 12 + 2                    # 28 parameter tensors (AdamW: a 4-byte step each)
D = 4
# Megatron-DDP (no_shard, optim): one bucket, padded to a multiple of 4: 30212 elements.
DDP_BUFFER = 30212
# Megatron-FSDP: each unit padded to a multiple of 4: the root 4672, each layer 12772
# (3 elements of padding); rank 0's shard: 1168 + 2 x 3193 = 7554 elements.
FSDP_UNITS = [ROOT, 12772, 12772]
FSDP_SHARD = sum(u // D for u in FSDP_UNITS)
# Pieces of parameters in rank 0's shards (an AdamW step tensor each):
# optim: the buffer holds the parameters in reverse; rank 0's [0, 7553) holds the final
# LayerNorm's bias and weight, layer 1's fc2 bias and weight, fc1 bias and part of its weight: 6.
# FSDP: the root's [0, 1168) is the word embedding only; a layer's [0, 3193) holds the input
# LayerNorm's weight and bias, qkv's weight (to 3136) and part of its bias: 4 per layer. 9.
EXPECTED_RESIDENT = {
    "no_shard": dict(param_bytes=4 * DDP_BUFFER, grad_bytes=4 * DDP_BUFFER,
                     optimizer_state_bytes=8 * PSI + 4 * TENSORS),
    "optim": dict(param_bytes=4 * DDP_BUFFER, grad_bytes=4 * DDP_BUFFER,
                  optimizer_state_bytes=8 * (DDP_BUFFER // D) + 4 * 6),
    "optim_grads": dict(param_bytes=4 * sum(FSDP_UNITS), grad_bytes=4 * FSDP_SHARD,
                        optimizer_state_bytes=8 * FSDP_SHARD + 4 * 9),
    "optim_grads_params": dict(param_bytes=4 * FSDP_SHARD, grad_bytes=4 * FSDP_SHARD,
                               optimizer_state_bytes=8 * FSDP_SHARD + 4 * 9),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Rank 0's reports of the 4-rank job and of the 2-rank job that loads its checkpoint."""
    root = tmp_path_factory.mktemp("fsdp_ckpt")
    out = {}
    for part, nproc in (("four", 4), ("two", 2)):
        job = run(WORKER, [part, str(root)], nproc=nproc, timeout_s=480, show="none")
        assert len(job.results) == nproc                # in rank order (the launcher)
        out[part] = job.results[0]
    return out


def _layout(reports, layout):
    return reports["four" if layout in ("dp4", "tp2_dp2") else "two"][layout]


@pytest.mark.parametrize("layout", ["dp4", "dp2", "tp2_dp2"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_trains_as_plain_data_parallelism(reports, layout, strategy):
    rows = _layout(reports, layout)
    assert rel_diff(rows[strategy]["losses"], rows["plain"]["losses"]) <= LOSS_RTOL
    assert len(rows[strategy]["losses"]) == 3
    assert rows[strategy]["param_names_equal"]
    assert rows[strategy]["max_param_diff"] <= PARAM_ATOL


def test_zero3_with_whole_layers_recomputed_trains_as_plain_data_parallelism(reports):
    """The recomputation runs a unit's forward again inside backward: its parameters must be
    gathered for it and kept for the backward, and nothing prefetched in forward order (a
    stale gather would be installed at the next step's forward)."""
    rows = _layout(reports, "dp4")
    row = rows["optim_grads_params_recompute"]
    assert rel_diff(row["losses"], rows["plain"]["losses"]) <= LOSS_RTOL
    assert row["max_param_diff"] <= PARAM_ATOL


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resident_bytes_at_dp4_are_the_hand_worked_ones(reports, strategy):
    assert _layout(reports, "dp4")[strategy]["resident"] == EXPECTED_RESIDENT[strategy]


def test_each_strategy_shards_one_more_term_to_a_quarter_up_to_padding(reports):
    """no_shard -> optim: optimizer states; -> optim_grads: gradients too; ->
    optim_grads_params: parameters too. 4 x a shard is the whole plus the padding."""
    got = {s: _layout(reports, "dp4")[s]["resident"] for s in STRATEGIES}
    adam = {s: got[s]["optimizer_state_bytes"] - 4 * n
            for s, n in zip(STRATEGIES, (TENSORS, 6, 9, 9))}     # without AdamW's step tensors
    assert D * adam["optim"] - adam["no_shard"] == 8 * (DDP_BUFFER - PSI)    # 2 padding
    assert D * got["optim_grads"]["grad_bytes"] - got["optim"]["grad_bytes"] == \
        4 * (sum(FSDP_UNITS) - DDP_BUFFER)                                   # 6 vs 2 padding
    assert D * got["optim_grads_params"]["param_bytes"] == got["optim_grads"]["param_bytes"]
    assert got["optim_grads"]["param_bytes"] == got["optim"]["param_bytes"] + 4 * 4
    assert got["optim"]["param_bytes"] == got["no_shard"]["param_bytes"]


def _ring_bytes(row, d):
    """Bytes this rank sent for the data-parallel collectives of one step (scalars - the loss
    average, the gradient norm - left out), from the inputs CommDebugMode saw."""
    total, kinds = 0.0, collections.Counter()
    for kind, group, nbytes in row["collectives"]:
        if group == row["data_parallel_group"] and nbytes > 8:
            total += ring_bytes(kind, nbytes, d)
            kinds[kind] += 1
    return total, kinds


def test_bytes_per_step_are_zero_s_formulas(reports):
    rows = _layout(reports, "dp4")
    sent = {s: _ring_bytes(rows[s], D) for s in STRATEGIES}
    # no_shard: one all-reduce of the padded buffer, 2(d-1)/d Ψ
    assert sent["no_shard"][1] == {"all_reduce": 1}
    assert sent["no_shard"][0] == pytest.approx(2 * (D - 1) / D * 4 * DDP_BUFFER)
    assert sent["no_shard"][0] == pytest.approx(
        data_parallel_bytes_per_step("no_shard", 4 * DDP_BUFFER, D))
    # optim: a reduce-scatter and an all-gather, the same bytes
    assert sent["optim"][0] == pytest.approx(sent["no_shard"][0])
    # ZeRO-3: every unit gathered twice (forward, backward), reduce-scattered once: 3(d-1)/d Ψ
    assert sent["optim_grads_params"][1] == {"all_gather": 6, "reduce_scatter": 3}
    assert sent["optim_grads_params"][0] == pytest.approx(3 * (D - 1) / D * 4 * sum(FSDP_UNITS))
    # ZeRO-2: a reduce-scatter and one all-gather per unit, 2(d-1)/d Ψ
    assert sent["optim_grads"][0] == pytest.approx(2 * (D - 1) / D * 4 * sum(FSDP_UNITS))
    assert sent["optim_grads_params"][0] / sent["no_shard"][0] == pytest.approx(1.5, rel=1e-3)


def test_zero3_checkpoint_at_dp4_resumes_under_no_shard_at_dp2(reports):
    """The next loss (the parameters restored) and the one after (the Adam states too, each
    rank's shard of the whole states saved), as the uninterrupted run's."""
    saved = reports["four"]["zero3_saved"]
    for strategy in ("no_shard", "optim_grads_params"):
        resumed = reports["two"]["resumed"][strategy]
        assert resumed["iterations"] == saved["iterations"] == [4, 5]
        assert rel_diff(resumed["losses"], saved["losses"]) <= LOSS_RTOL
