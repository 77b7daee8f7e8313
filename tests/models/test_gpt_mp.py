"""GPTModel under tensor, sequence and data parallelism against its dense twin, the collective
count, the shape table, resharding checkpoints (in the shared 4-rank job), and launch/train_gpt.py."""
import json
import pathlib
import shutil

import pytest
import torch

from mpu_lab.training import checkpointing
from mpu_lab.launcher import run
from mpu_lab.training.plain_gpt import PlainGPT
from mpu_lab.core.transformer import TransformerConfig
from mp_reports import rel_diff

pytestmark = pytest.mark.slow
RTOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint_root(four_rank_job):
    return four_rank_job[1]


@pytest.fixture(scope="module")
def reports(four_rank_job):
    """Each rank's dict from tests/mp/gpt_checks.py's checks, run in the shared 4-rank job
    (tests/mp/four_rank_checks.py; ``four_rank_job`` in conftest.py)."""
    return [rep["gpt"] for rep in four_rank_job[0]]


def test_tp_shards_are_slices_of_the_tp1_master_weights(reports):
    # every configuration's gathered weights equal the first (TP=1) configuration's
    for r in reports:
        assert r["same_initial_weights"] == {"tp1": True, "tp2": True, "tp2_sp": True,
                                             "tp4": True, "tp4_sp": True}


@pytest.mark.parametrize("config", ["tp1", "tp2", "tp2_sp", "tp4", "tp4_sp"])
def test_losses_match_the_dense_twin_for_12_iterations(reports, config):
    for r in reports:
        losses = r["losses"][config]
        assert len(losses) == 12
        assert rel_diff(losses, r["dense_losses"]) <= RTOL
        assert rel_diff(losses, r["losses"]["tp1"]) <= RTOL
    assert reports[0]["losses"][config][-1] < reports[0]["losses"][config][0] - 0.3   # it learns


def test_data_parallel_matches_dp1_at_the_same_global_batch(reports):
    r = reports[0]
    assert r["dp"] == {"tp1": 4, "tp2": 2, "tp2_sp": 2, "tp4": 1, "tp4_sp": 1}
    assert rel_diff(r["losses"]["tp1"], r["dense_losses"]) <= RTOL        # DP=4 vs one process
    assert rel_diff(r["losses"]["tp2"], r["losses"]["tp4"]) <= RTOL       # DP=2 vs DP=1
    assert r["micro_batches"]["tp2"] == 2                                 # with accumulation


def test_metrics_have_the_contract_keys(reports):
    assert {"iteration", "lm_loss", "grad_norm", "lr", "iteration_time_s",
            "tokens_per_s"} <= set(reports[0]["metric_keys"])


# Per transformer layer and training step at TP=2, counted by torch's CommDebugMode from
# outside the model. Shoeybi et al. 2019, §3, Fig. 4: g after attention and after the MLP
# (forward), f before them (backward): 2 all-reduces each way. Korthikanti et al. 2022,
# §4.2.2: with sequence parallelism each g is a reduce-scatter and each f an all-gather, their
# backward the other; plus, in backward, each of the two column-parallel linears gathers its
# [s/t, b, h] input again for its weight gradient (Megatron's linear keeps only the block).
LAYER_COUNTS = {
    "no_sp": {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}},
    "sp": {"forward": {"all_gather": 2, "reduce_scatter": 2},
           "backward": {"all_gather": 4, "reduce_scatter": 2}},
}


@pytest.mark.parametrize("sp", ["no_sp", "sp"])
def test_collectives_per_layer_at_tp2(reports, sp):
    for r in reports:
        for step_counts in r["counts"][sp]:                           # two steps
            for layer in (0, 1):
                assert step_counts[f"layer{layer}.forward"] == LAYER_COUNTS[sp]["forward"]
                assert step_counts[f"layer{layer}.backward"] == LAYER_COUNTS[sp]["backward"]
    if sp == "sp":
        assert reports[0]["counts"]["sp"][0]["grads.sequence_parallel"] == {"all_reduce": 1}
    else:
        assert "grads.sequence_parallel" not in reports[0]["counts"]["no_sp"][0]


def test_collective_events_name_group_and_bytes(reports):
    # layer0 forward, TP=2 without SP: two all-reduces of [s, b, h] fp32 over the TP group.
    for r in reports:
        events = r["layer_events"]["no_sp"]
        assert [e["kind"] for e in events] == ["all_reduce", "all_reduce"]
        assert all(e["bytes"] == 32 * 2 * 64 * 4 for e in events)   # seq 32, mbs 2, hidden 64
        tp_group = [r["rank"] - r["rank"] % 2, r["rank"] - r["rank"] % 2 + 1]
        assert all(e["group"] == tp_group for e in events)
        sp_events = r["layer_events"]["sp"]
        assert [e["kind"] for e in sp_events] == ["all_gather", "reduce_scatter"] * 2
        assert sp_events[0]["bytes"] == 16 * 2 * 64 * 4       # all-gather of this rank's [s/t, b, h]
        assert sp_events[1]["bytes"] == 32 * 2 * 64 * 4       # reduce-scatter of partial [s, b, h]


@pytest.mark.parametrize("tp", [2, 4])
def test_shape_table_read_off_live_tensors_matches_the_lecture(reports, tp):
    rows = reports[0][f"shape_table_tp{tp}"]
    assert [r["name"] for r in rows] == ["Q", "K", "V", "Q_i", "K_i", "V_i", "Score_i", "Z_i",
                                         "Z", "Out", "A", "A'", "x'"]
    for row in rows:
        assert row["shape"] == row["expected"], row
    by_name = {r["name"]: r for r in rows}
    # The lecture's table worked by hand for B = 2, L = 8, D = 16, n_H = 4 (so H = 4):
    # Q, K, V: B x L x D/d_tp; a head: B x L x H; Score_i: B x L x L; Z: B x L x D/d_tp;
    # Out and x': B x L x D; A, A': B x L x 4D/d_tp.
    lecture = {2: {"Q": [2, 8, 8], "K": [2, 8, 8], "V": [2, 8, 8], "Q_i": [2, 8, 4],
                   "K_i": [2, 8, 4], "V_i": [2, 8, 4], "Score_i": [2, 8, 8], "Z_i": [2, 8, 4],
                   "Z": [2, 8, 8], "Out": [2, 8, 16], "A": [2, 8, 32], "A'": [2, 8, 32],
                   "x'": [2, 8, 16]},
               4: {"Q": [2, 8, 4], "K": [2, 8, 4], "V": [2, 8, 4], "Q_i": [2, 8, 4],
                   "K_i": [2, 8, 4], "V_i": [2, 8, 4], "Score_i": [2, 8, 8], "Z_i": [2, 8, 4],
                   "Z": [2, 8, 4], "Out": [2, 8, 16], "A": [2, 8, 16], "A'": [2, 8, 16],
                   "x'": [2, 8, 16]}}[tp]
    assert {name: list(r["shape"]) for name, r in by_name.items()} == lecture
    assert by_name["Q"]["shape"] == [2, 8, 16 // tp]          # B x L x D/d_tp
    assert by_name["Score_i"]["per_rank"] == 4 // tp          # n_H/d_tp heads here
    assert by_name["A"]["shape"] == [2, 8, 64 // tp]          # B x L x 4D/d_tp


@pytest.mark.parametrize("tp", ["tp4", "tp1", "tp2"])
def test_checkpoint_saved_at_tp2_loads_at_other_sizes_and_training_continues(reports, tp):
    for r in reports:
        assert r["loaded_iteration"][tp] == 6
        assert r["loaded_identical"][tp] is True                 # bit-identical parameters
        assert rel_diff(r["resumed"][tp], r["resume_reference"]) <= RTOL


def test_consolidated_checkpoint_is_one_ordinary_state_dict(reports, tmp_path):
    import hashlib
    path = reports[0]["saved_path"]
    out = tmp_path / "model.pt"
    from mpu_lab.training.checkpointing import main
    assert main(["consolidate", path, str(out)]) == 0
    sd = torch.load(out)
    digest = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in sd.items()}
    assert digest == reports[0]["saved_digest"]
    twin = PlainGPT.from_config(TransformerConfig(num_layers=2, hidden_size=64,
                                                  num_attention_heads=4), 256, 32)
    twin.load_state_dict(sd)   # TP=1 names, no resharding left to do


def test_missing_partial_and_mismatched_checkpoints_are_named(reports, tmp_path, checkpoint_root):
    saved = pathlib.Path(reports[0]["saved_path"])
    with pytest.raises(checkpointing.CheckpointError, match="does not exist"):
        checkpointing.find_checkpoint(tmp_path / "nowhere")
    with pytest.raises(checkpointing.CheckpointError, match="neither"):
        checkpointing.find_checkpoint(tmp_path)
    parent = tmp_path / "run"
    shutil.copytree(saved, parent / "iter_0000010")
    shutil.copytree(saved, parent / "iter_0000020")
    (parent / "iter_0000020" / ".metadata").unlink()          # interrupted inside DCP
    assert checkpointing.find_checkpoint(parent).name == "iter_0000010"
    with pytest.raises(checkpointing.CheckpointError, match="partial: it has no .metadata"):
        checkpointing.find_checkpoint(parent / "iter_0000020")
    (parent / "iter_0000010" / checkpointing.MARKER).unlink()  # interrupted after DCP
    with pytest.raises(checkpointing.CheckpointError, match="no complete checkpoint"):
        checkpointing.find_checkpoint(parent)
    from mpu_lab import training
    args = training.validate_args(training.parse_args(
        ["--num-layers", 2, "--hidden-size", 128, "--num-attention-heads", 4, "--seq-length", 32,
         "--vocab-size", 256, "--make-vocab-size-divisible-by", 64, "--load", str(saved)]), 1,
        check_load=False)
    with pytest.raises(checkpointing.CheckpointError, match="hidden_size: checkpoint 64, this run 128"):
        checkpointing.check_compatible(checkpointing.read_checkpoint_info(saved), args)
    # a change of the vocabulary's padding (256 rows at the saved TP, 512 at TP=4 with the
    # default divisor 128) is resharding: the loader trims or zero-fills the dummy rows
    flags = ["--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4,
             "--seq-length", 32, "--tensor-model-parallel-size", 4, "--load", str(saved)]
    assert training.validate_args(training.parse_args(flags + ["--vocab-size", 256]),
                                  4).padded_vocab_size == 512
    # a change of the real vocabulary is refused, before any process starts
    with pytest.raises(checkpointing.CheckpointError,
                       match="vocab_size: checkpoint 256, this run 200.*use --vocab-size 256"):
        training.validate_args(training.parse_args(flags + ["--vocab-size", 200]), 4)


def test_train_gpt_script_writes_metrics_saves_and_resumes_at_another_tp_and_pp(tmp_path):
    common = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
              "--seq-length", "16", "--micro-batch-size", "4", "--vocab-size", "128",
              "--make-vocab-size-divisible-by", "32", "--train-iters", "12",
              "--log-interval", "4", "--save", str(tmp_path / "ckpt")]
    metrics = tmp_path / "metrics.jsonl"
    job = run("train_gpt.py", common + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                        "--save-interval", "8", "--metrics-file", str(metrics)],
              nproc=2, timeout_s=120, show="none")
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [m["iteration"] for m in lines] == [4, 8, 12]
    for m in lines:
        assert {"iteration", "lm_loss", "grad_norm", "lr", "iteration_time_s", "tokens_per_s"} <= set(m)
    assert job.results[0]["metrics"][-1]["lm_loss"] == lines[-1]["lm_loss"]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*")) == ["iter_0000008", "iter_0000012"]
    # Saved at TP=2, resumed at PP=2 (1F1B, 2 micro-batches of 2) with each rank's timeline.
    resumed = run("train_gpt.py", common[:-2] + ["--train-iters", "16", "--load", str(tmp_path / "ckpt"),
                                                 "--pipeline-model-parallel-size", "2",
                                                 "--micro-batch-size", "2", "--global-batch-size", "4",
                                                 "--record-timeline"],
                  nproc=2, timeout_s=120, show="none")
    assert [m["iteration"] for m in resumed.results[0]["metrics"]] == [16]
    assert [m["lm_loss"] for r in resumed.results for m in r["metrics"]] == \
        [resumed.results[1]["metrics"][0]["lm_loss"]] * 2    # stage 0 got the last stage's loss
    from mpu_lab.perf.pipeline_timeline import pipeline_records
    from mpu_lab.perf.pipeline_order import schedule_order
    timeline = pipeline_records(resumed.results)
    assert (timeline["schedule"], timeline["num_microbatches"], timeline["ranks"]) == ("1F1B", 2, [0, 1])
    assert [[list(r[:3]) for r in recs] for recs in timeline["records"]] == \
        [[list(op) for op in schedule_order("1f1b", 2, stage, 2)] for stage in (0, 1)]


def test_train_gpt_script_checks_its_flags_before_starting_torch_distributed(monkeypatch, capsys):
    import importlib.util

    from mpu_lab.launcher import LAUNCH_DIR
    spec = importlib.util.spec_from_file_location("train_gpt", LAUNCH_DIR / "train_gpt.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_:
        script.main(["--tensor-model-parallel-size", "3"])
    assert exit_.value.code == 2
    assert ("--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"
            in capsys.readouterr().err)
