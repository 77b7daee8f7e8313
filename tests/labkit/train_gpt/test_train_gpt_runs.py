"""Lab 14's helpers: loss curves (mpu_lab.labkit.train_gpt.viz), the runs and launch lines
(mpu_lab.labkit.train_gpt.runs), the checks and launcher.run's on_line."""
import pytest

from mpu_lab import launcher
from mpu_lab.labkit.train_gpt import runs as gpt_runs, viz


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


# --------------------------------------------------------------------------- lab 14
def test_gpt_flags_and_command_line():
    flags = gpt_runs.gpt_flags(20, tensor_model_parallel_size=2, sequence_parallel=True, load=None)
    assert flags[-3:] == ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert "--train-iters" in flags and "--load" not in flags
    assert gpt_runs.command_line(["--a", 1], 2) == \
        "torchrun --standalone --nproc-per-node 2 launch/train_gpt.py --a 1"
    long = ["--num-layers", 2, "--hidden-size", 64, "--seq-length", 64, "--sequence-parallel",
            "--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2]
    wrapped = gpt_runs.command_line(long, 4, width=60)
    lines = wrapped.splitlines()
    assert max(map(len, lines)) <= 60 and all(ln.endswith(" \\") for ln in lines[:-1])
    assert wrapped.replace(" \\\n    ", " ") == gpt_runs.command_line(long, 4)
    assert "--tensor-model-parallel-size 2" in lines[-2] + lines[-1]


def test_launch_lines_split_into_flags_and_the_lecture_line_fits_8_ranks(capsys):
    pairs = dict(gpt_runs.split_flags(gpt_runs.LECTURE_GPT_ARGS))
    assert pairs["--num-layers"] == "24" and pairs["--fp16"] is None and len(pairs) == 19
    script = dict(gpt_runs.split_flags(gpt_runs.gpt_args_from_script()))
    assert "--tensor-model-parallel-size" in script
    d = gpt_runs.derived(gpt_runs.LECTURE_GPT_ARGS, 8)
    assert (d["data_parallel_size"], d["num_micro_batches"], d["lr_warmup_steps"]) == (2, 2, 3200)
    gpt_runs.print_derived(gpt_runs.LECTURE_GPT_ARGS, 6)
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 100
    assert ("refused: --tensor-model-parallel-size 2 and "
            "--pipeline-model-parallel-size 2 do not fit 6 ranks") in " ".join(out.split())
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
    gpt_runs.print_losses([ref, later], every=2, first=2)   # the first loss left out
    assert capsys.readouterr().out.splitlines()[1:] == ["        2   2.0000   2.0000",
                                                        "        3   1.0000   1.5000"]
    with pytest.raises(ValueError, match=r"first=4 is past every logged iteration \(the runs "
                                         r"logged iterations 1-3\); use first <= 3"):
        gpt_runs.print_losses([ref, later], first=4)
    assert ref.ranks_agree and ref.curve == ([1, 2, 3], [3.0, 2.0, 1.0])
    with pytest.raises(ValueError, match="no iteration in common"):
        gpt_runs.max_relative_difference(run_of("x", [9], [1.0]), ref)


def test_a_comparison_up_to_an_iteration_and_the_first_iteration_apart(capsys):
    # EP = 2 against EP = 1 (lab 13): equal until a re-routed token parts them at iteration 3
    ref = run_of("EP=1", [1, 2, 3, 4], [4.0, 2.0, 1.0, 1.0])
    parted = run_of("EP=2", [1, 2, 3, 4], [4.0, 2.000004, 1.001, 1.0])
    assert gpt_runs.max_relative_difference(parted, ref, last=2) == pytest.approx(2e-6)
    assert gpt_runs.max_relative_difference(parted, ref) == pytest.approx(1e-3)
    assert gpt_runs.first_iteration_apart(parted, ref, rtol=1e-5) == 3
    assert gpt_runs.first_iteration_apart(parted, ref, rtol=1e-2) is None
    assert gpt_runs.print_agreement([parted], ref, last=2)
    assert not gpt_runs.print_agreement([parted], ref)
    out = capsys.readouterr().out.splitlines()
    assert "iterations 1-2," in out[0] and out[0].endswith("the same losses")
    assert "iterations 1-4," in out[1] and out[1].endswith("DIFFERENT")
    with pytest.raises(ValueError, match="no iteration in common up to iteration 0"):
        gpt_runs.max_relative_difference(parted, ref, last=0)


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
