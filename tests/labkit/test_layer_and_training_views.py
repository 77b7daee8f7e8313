"""Labs 07 and 11's helpers: the layer and loss pictures (mpu_lab.labkit.viz), lab 11's runs and launch
lines (mpu_lab.labkit.gpt_runs), the labs' checks (mpu_lab.labkit.exercises) and launcher.run's on_line."""
import pytest
from matplotlib.figure import Figure

from mpu_lab import launcher
from mpu_lab.labkit import exercises, gpt_runs, viz
from mpu_lab.perf import saved_activations




# --------------------------------------------------------------------------- lab 07
def test_lecture_shapes_are_what_the_live_layer_records_at_d_tp_1(world):
    from mpu_lab.perf.layer_shapes import shape_table
    rows = shape_table(2, 8, 16, 4, tensor_model_parallel_size=1)
    expected = exercises.lecture_shapes(2, 8, 16, 4, 1)
    assert {r["name"]: (r["shape"], r["per_rank"]) for r in rows} == expected


def test_lecture_shapes_cut_only_inside_the_blocks():
    shapes = exercises.lecture_shapes(4, 1024, 1024, 16, 2)
    assert shapes["A"] == ((4, 1024, 2048), 1) and shapes["Score_i"] == ((4, 1024, 1024), 8)
    assert shapes["Out"] == shapes["x'"] == ((4, 1024, 1024), 1)


def test_valid_tensor_parallel_sizes_divide_the_heads():
    assert exercises.valid_tensor_parallel_sizes(768, 12) == [1, 2, 3, 4, 6, 12]
    assert exercises.valid_tensor_parallel_sizes(16, 4) == [1, 2, 4]


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True), (4, True)])
def test_layer_diagram_has_the_attention_and_the_mlp_panel(tp, sp):
    fig = viz.plot_transformer_layer(tp, sequence_parallel=sp)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    title = fig.axes[0].get_title(loc="left")
    assert ("all-gather" in title) == sp and f"t = {tp}" in title


def test_memory_picture_stacks_both_accountings_and_marks_the_measurement():
    rows = [saved_activations.compare(128, 2, 64, 8, t, sp,
                           saved_activations.total(saved_activations.mpu_lab_terms(128, 2, 64, 8, t, sp)))
            for t, sp in ((1, False), (2, False), (2, True))]
    fig = viz.plot_activation_memory(rows, 128, 2, 64)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "measured (saved-tensor hooks)" in labels and saved_activations.MASKS in labels
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()][0].startswith("TP=1")


def test_loss_curves_add_a_difference_panel_and_a_checkpoint_line():
    its = list(range(1, 11))
    curves = {"TP=1": (its, [5.0 - 0.1 * i for i in its]), "TP=2": (its, [5.0 - 0.1 * i for i in its])}
    assert len(viz.plot_loss_curves(curves).axes) == 1
    fig = viz.plot_loss_curves(curves, reference="TP=1", checkpoint_at=5)
    assert len(fig.axes) == 2 and fig.axes[1].get_yscale() == "log"


def test_live_plot_outside_a_notebook_draws_without_a_display():
    plot = viz.LiveLossPlot("x", 10, every_s=0.0)
    assert plot.handle is None
    plot.update([1, 2], [3.0, 2.5])
    assert list(plot.line.get_xdata()) == [1, 2]


@pytest.mark.parametrize("check,right,wrong", [
    (lambda a: exercises.check_layer_shape(a, "A", 4, 1024, 1024, 16, 2), (4, 1024, 2048), (4, 1024, 4096)),
    (lambda a: exercises.check_layer_shape(a, "Score_i", 4, 1024, 1024, 16, 4), (4, 1024, 1024), (4, 1024, 256)),
    (lambda a: exercises.check_tensor_parallel_sizes(a, 768, 12), [1, 2, 3, 4, 6, 12], [1, 2, 4, 8]),
    (lambda a: exercises.check_layer_collectives(a, True), (0, 6, 4), (0, 4, 4)),
    (lambda a: exercises.check_layer_collectives(a, False), (4, 0, 0), (2, 0, 0)),
    (lambda a: exercises.check_activation_memory_mib(a, 2048, 1, 12288, 96, 8, True), 342, 552),
    (lambda a: exercises.check_micro_batches(a, gpt_runs.LECTURE_GPT_ARGS, 16), 1, 2),
    (lambda a: exercises.check_padded_vocab(a, 50257, 128, 4), 50688, 50304),
])
def test_lab05_and_lab07_checks_say_right_wrong_or_not_yet(capsys, check, right, wrong):
    assert check(right) and capsys.readouterr().out.startswith("Right:")
    assert not check(wrong) and capsys.readouterr().out.startswith("Not yet:")
    assert not check(None) and capsys.readouterr().out.startswith("No answer yet:")


def test_layer_shape_check_names_the_tensors_it_knows():
    with pytest.raises(ValueError, match="no tensor 'B'"):
        exercises.check_layer_shape((1,), "B", 1, 1, 4, 2, 1)


# --------------------------------------------------------------------------- lab 11
def test_gpt_flags_and_command_line():
    flags = gpt_runs.gpt_flags(20, tensor_model_parallel_size=2, sequence_parallel=True, load=None)
    assert flags[-3:] == ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert "--train-iters" in flags and "--load" not in flags
    assert gpt_runs.command_line(["--a", 1], 2) == \
        "torchrun --standalone --nproc-per-node 2 launch/train_gpt.py --a 1"


def test_launch_lines_split_into_flags_and_the_lecture_line_fits_8_ranks(capsys):
    pairs = dict(gpt_runs.split_flags(gpt_runs.LECTURE_GPT_ARGS))
    assert pairs["--num-layers"] == "24" and pairs["--fp16"] is None and len(pairs) == 19
    script = dict(gpt_runs.split_flags(gpt_runs.gpt_args_from_script()))
    assert "--tensor-model-parallel-size" in script
    d = gpt_runs.derived(gpt_runs.LECTURE_GPT_ARGS, 8)
    assert (d["data_parallel_size"], d["num_micro_batches"], d["lr_warmup_steps"]) == (2, 2, 3200)
    gpt_runs.print_derived(gpt_runs.LECTURE_GPT_ARGS, 6)
    assert ("refused: --tensor-model-parallel-size 2 and "
            "--pipeline-model-parallel-size 2 do not fit 6 ranks") in capsys.readouterr().out
    gpt_runs.print_side_by_side("--a 1 --b", "--a 2 --c x")
    assert capsys.readouterr().out.splitlines()[1:] == [
        "--a           1             2", "--b          on             -", "--c           -             x"]
    with pytest.raises(ValueError, match="follows no flag"):
        gpt_runs.split_flags("7 --a")


def run_of(label, its, losses):
    return gpt_runs.TrainRun(label, its, losses, [{"metrics": [{"lm_loss": v} for v in losses]}], 0.0, 1)


def test_comparisons_use_common_iterations_and_print_rounded_losses(capsys):
    ref = run_of("TP=1", [1, 2, 3], [3.0, 2.0, 1.0])
    same = run_of("TP=2", [1, 2, 3], [3.0, 2.00001, 1.0])
    later = run_of("resumed", [2, 3], [2.0, 1.5])
    assert gpt_runs.max_relative_difference(same, ref) == pytest.approx(5e-6)
    assert gpt_runs.max_relative_difference(later, ref) == pytest.approx(0.5)
    assert gpt_runs.print_agreement([same], ref) and not gpt_runs.print_agreement([later], ref)
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("the same losses") and "iterations 2-3" in out[1] and out[1].endswith("DIFFERENT")
    gpt_runs.print_losses([ref, later], every=2)
    assert capsys.readouterr().out.splitlines() == [
        "iteration     TP=1  resumed", "        1   3.0000        -",
        "        2   2.0000   2.0000", "        3   1.0000   1.5000"]
    gpt_runs.print_losses([later, ref], every=5)      # only the first and the last
    assert capsys.readouterr().out.splitlines()[1:] == ["        1        -   3.0000",
                                                        "        3   1.5000   1.0000"]
    assert ref.ranks_agree and ref.curve == ([1, 2, 3], [3.0, 2.0, 1.0])
    with pytest.raises(ValueError, match="no iteration in common"):
        gpt_runs.max_relative_difference(run_of("x", [9], [1.0]), ref)


def test_a_bad_launch_line_fails_before_any_process_starts():
    with pytest.raises(ValueError, match="--num-attention-heads 4 is not divisible"):
        gpt_runs.train(gpt_runs.gpt_flags(2, tensor_model_parallel_size=8), nproc=8)


@pytest.mark.slow
def test_on_line_sees_every_line_as_it_arrives():
    seen = []
    job = launcher.run("rank_groups.py", ["--tp", 1, "--pp", 1], nproc=1, show="none",
                     on_line=lambda rank, text: seen.append((rank, text)))
    assert seen == job.lines and any(r == 0 and t.startswith("rank 0:") for r, t in seen)


@pytest.mark.slow
def test_live_training_run_returns_every_iteration_and_saves_a_checkpoint(tmp_path):
    run = gpt_runs.train(gpt_runs.gpt_flags(4, tensor_model_parallel_size=2, save=tmp_path,
                                                save_interval=2), nproc=2, live=True)
    assert run.label == "TP=2" and run.iterations == [1, 2, 3, 4] and run.ranks_agree
    listing = gpt_runs.checkpoint_listing(tmp_path)
    assert listing[0].startswith("iter_0000002/  iteration 2, saved at TP=2")
    assert listing[-1] == "latest_checkpointed_iteration.txt  (4)"
