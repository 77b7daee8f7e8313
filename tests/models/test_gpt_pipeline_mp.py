"""GPT training with pipeline parallelism (GPipe, 1F1B, interleaved; PP=4 x DP=2 and
TP=2 x PP=2 x DP=2) against the TP=1/PP=1 run, the tied embedding, the metrics file, the real
run's timeline, and checkpoints resharded across pipeline sizes — in the shared 8-rank job."""
import json

import pytest
import torch

from mpu_lab.training import checkpointing
from mpu_lab.labkit.pipeline_parallel.viz import plot_gantt
from mpu_lab.training.plain_gpt import PlainGPT
from mpu_lab.core.transformer import TransformerConfig
from mpu_lab.perf.pipeline_timeline import measured_bubble, pipeline_records
from mpu_lab.core.pipeline_parallel import canonical_schedule, partition_table
from mpu_lab.perf.pipeline_order import schedule_order
from mp_reports import rel_diff

pytestmark = pytest.mark.slow
RTOL = 1e-5
# As in mp/gpt_pipeline_checks.py: name -> (TP, PP, v, schedule)
PIPELINED = {
    "pp4_gpipe": (1, 4, 1, "gpipe"),
    "pp4_1f1b": (1, 4, 1, "1f1b"),
    "pp4_interleaved": (1, 4, 2, "interleaved"),
    "tp2pp2_gpipe": (2, 2, 1, "gpipe"),
    "tp2pp2_1f1b_sp": (2, 2, 1, "1f1b"),
    "tp2pp2_interleaved": (2, 2, 2, "interleaved"),
}


@pytest.fixture(scope="module")
def job_paths(eight_rank_job):
    root = eight_rank_job[1]
    return root / "ckpt", root / "metrics.jsonl"


@pytest.fixture(scope="module")
def reports(eight_rank_job):
    """Each rank's dict from tests/mp/gpt_pipeline_checks.py's checks, run in the shared
    8-rank job (tests/mp/eight_rank_checks.py; ``eight_rank_job`` in conftest.py)."""
    return [rep["gpt_pipeline"] for rep in eight_rank_job[0]]


def test_every_stage_starts_from_the_pp1_weights_and_the_tied_copies_agree(reports):
    for r in reports:
        assert r["same_initial_weights"] == {k: True for k in PIPELINED}
        assert all(r["embedding_copies_equal"].values())


@pytest.mark.parametrize("name", list(PIPELINED))
def test_losses_match_the_tp1_pp1_run_for_6_iterations(reports, name):
    reference = reports[0]["losses"]["ref"]     # the one-process twin at TP=1/PP=1
    assert len(reference) == 6 and reference[-1] < reference[0]
    for r in reports:                      # every rank reports the last stage's loss
        assert len(r["losses"][name]) == 6
        assert rel_diff(r["losses"][name], reference) <= RTOL
        # The tied embedding is counted once in the clipped norm, as at PP=1.
        assert rel_diff(r["grad_norms"][name], reports[0]["grad_norms"]["ref"]) <= RTOL


@pytest.mark.parametrize("name", list(PIPELINED))
def test_stages_hold_the_layers_of_the_partition_table(reports, name):
    tp, pp, v, schedule = PIPELINED[name]
    rows = partition_table(8, pp, v if v > 1 else None)
    for r in reports:
        got = r["setup"][name]
        assert (canonical_schedule(got["schedule"]), got["dp"], got["m"], got["chunks"]) == (schedule, 8 // (tp * pp), 4, v)
        mine = [row for row in rows if row["pp_rank"] == got["pp_rank"]]
        assert got["layers"] == [list(row["layers"]) for row in mine]
        assert got["pre_post"] == [[row["pre_process"], row["post_process"]] for row in mine]


def test_metrics_file_is_written_by_rank_0_with_the_last_stages_loss(reports, job_paths):
    lines = [json.loads(x) for x in job_paths[1].read_text().splitlines()]
    assert [m["iteration"] for m in lines] == list(range(1, 7))
    for m in lines:
        assert {"iteration", "lm_loss", "grad_norm", "lr", "iteration_time_s", "tokens_per_s"} <= set(m)
    assert [m["lm_loss"] for m in lines] == reports[0]["losses"]["tp2pp2_1f1b_sp"]


@pytest.mark.parametrize("name", list(PIPELINED))
def test_the_executed_order_recorded_from_outside_equals_schedule_order(reports, name):
    """Every rank of every pipeline ran its stage's op order of the planner, as a recorder
    hooked on the model chunks saw it during the last training iteration."""
    tp, pp, v, schedule = PIPELINED[name]
    timelines = [{"timeline": r["timeline"][name]} for r in reports]
    for dp_rank in range(8 // (tp * pp)):
        for tp_rank in range(tp):
            tl = pipeline_records(timelines, data_parallel_rank=dp_rank, tensor_parallel_rank=tp_rank)
            assert (canonical_schedule(tl["schedule"]), tl["num_microbatches"], tl["num_model_chunks"]) == (schedule, 4, v)
            for stage, records in enumerate(tl["records"]):
                assert [list(rec[:3]) for rec in records] == \
                    [list(op) for op in schedule_order(schedule, pp, stage, 4, v)]


@pytest.mark.parametrize("name", ["pp4_1f1b", "tp2pp2_interleaved"])
def test_real_run_timeline_is_drawn_with_its_measured_bubble(reports, name, tmp_path):
    tp, pp, v, schedule = PIPELINED[name]
    tl = pipeline_records([{"timeline": r["timeline"][name]} for r in reports])
    got = measured_bubble(tl["records"], tl["num_microbatches"], tl["num_model_chunks"])
    assert got["analytic_share"] == pytest.approx((pp - 1) / (v * 4 + pp - 1))
    assert 0.0 < got["measured_share"] < 1.0           # indicative on an oversubscribed CPU
    fig = plot_gantt(tl["records"], title=f"{name} (measured)", time_unit="ms")
    fig.savefig(tmp_path / "gantt.png")
    assert len(fig.axes[0].collections) == pp * 2 * 4 * v


def test_missing_timeline_is_named():
    with pytest.raises(ValueError, match="--record-timeline"):
        pipeline_records([{"metrics": []}, None])


@pytest.mark.parametrize("name", ["tp1pp1", "pp4_interleaved"])
def test_checkpoint_saved_at_tp2_pp2_loads_at_other_pipeline_sizes_and_training_continues(reports, name):
    for r in reports:
        assert r["loaded_iteration"][name] == 3
        assert r["loaded_identical"][name] is True              # bit-identical parameters
        assert r["loaded_embedding_copies_equal"][name] is True
        assert len(r["resumed"][name]) == 3
        assert rel_diff(r["resumed"][name], r["resume_reference"]) <= RTOL


def test_pipeline_checkpoint_has_global_layer_names_and_consolidates(reports):
    path = reports[0]["saved_path"]
    info = checkpointing.read_checkpoint_info(path)
    assert (info["tensor_model_parallel_size"], info["pipeline_model_parallel_size"]) == (2, 2)
    sd = checkpointing.consolidate(path)
    assert "output_layer_weight" not in sd                      # the tied copy is not saved
    assert {int(k.split(".")[2]) for k in sd if k.startswith("decoder.layers.")} == set(range(8))
    twin = PlainGPT.from_config(TransformerConfig(num_layers=8, hidden_size=32,
                                                  num_attention_heads=4), 128, 16)
    twin.load_state_dict(sd)
    assert torch.isfinite(twin(torch.zeros(1, 16, dtype=torch.long))).all()
