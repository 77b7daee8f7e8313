"""Lab 09's helpers: the lecture's shape table, the layer and memory pictures
(mpu_lab.labkit.parallel_transformer.viz) and the lab's checks."""
import pytest
from matplotlib.figure import Figure

from mpu_lab.labkit.parallel_transformer import exercises, viz as parallel_transformer_viz
from mpu_lab.labkit.train_gpt import exercises as train_gpt_exercises, runs as gpt_runs
from mpu_lab.perf import saved_activations


# --------------------------------------------------------------------------- lab 09
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
    fig = parallel_transformer_viz.plot_transformer_layer(tp, sequence_parallel=sp)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    title = fig.axes[0].get_title(loc="left")
    assert ("all-gather" in title) == sp and f"t = {tp}" in title


def test_memory_picture_stacks_both_accountings_and_marks_the_measurement():
    rows = [saved_activations.compare(128, 2, 64, 8, t, sp,
                           saved_activations.total(saved_activations.mpu_lab_terms(128, 2, 64, 8, t, sp)))
            for t, sp in ((1, False), (2, False), (2, True))]
    fig = parallel_transformer_viz.plot_activation_memory(rows, 128, 2, 64)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "measured (saved-tensor hooks)" in labels and saved_activations.MASKS in labels
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()][0].startswith("TP=1")


@pytest.mark.parametrize("check,right,wrong", [
    (lambda a: exercises.check_layer_shape(a, "A", 4, 1024, 1024, 16, 2), (4, 1024, 2048), (4, 1024, 4096)),
    (lambda a: exercises.check_layer_shape(a, "Score_i", 4, 1024, 1024, 16, 4), (4, 1024, 1024), (4, 1024, 256)),
    (lambda a: exercises.check_tensor_parallel_sizes(a, 768, 12), [1, 2, 3, 4, 6, 12], [1, 2, 4, 8]),
    (lambda a: exercises.check_layer_collectives(a, True), (0, 6, 4), (0, 4, 4)),
    (lambda a: exercises.check_layer_collectives(a, False), (4, 0, 0), (2, 0, 0)),
    (lambda a: exercises.check_activation_memory_mib(a, 2048, 1, 12288, 96, 8, True), 342, 552),
    (lambda a: train_gpt_exercises.check_micro_batches(a, gpt_runs.LECTURE_GPT_ARGS, 16), 1, 2),
    (lambda a: train_gpt_exercises.check_padded_vocab(a, 50257, 128, 4), 50688, 50304),
])
def test_lab05_and_lab07_checks_say_right_wrong_or_not_yet(capsys, check, right, wrong):
    assert check(right) and capsys.readouterr().out.startswith("Right:")
    assert not check(wrong) and capsys.readouterr().out.startswith("Not yet:")
    assert not check(None) and capsys.readouterr().out.startswith("No answer yet:")


def test_layer_shape_check_names_the_tensors_it_knows():
    with pytest.raises(ValueError, match="no tensor 'B'"):
        exercises.check_layer_shape((1,), "B", 1, 1, 4, 2, 1)


def test_layer_diagram_names_the_activation_the_lab_runs():
    texts = lambda fig: " ".join(t.get_text() for ax in fig.axes for t in ax.texts)  # noqa: E731
    assert "relu" in texts(parallel_transformer_viz.plot_transformer_layer(2))
    assert "GeLU" not in texts(parallel_transformer_viz.plot_transformer_layer(2))
    assert "gelu" in texts(parallel_transformer_viz.plot_transformer_layer(2, activation="gelu"))
