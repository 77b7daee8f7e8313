"""Lab 03's write-the-code exercise, ``CHECKPOINT`` (activation recomputation with the RNG save
and restore), on the shared grading world (4 ranks; the exercise regroups it at TP = 2, dropout
on): the lab's solution passes and is saved under Megatron's name, ``checkpoint``, into the
learner's ``random.py`` (which the capstone reads); a checkpoint that restores nothing, one that
restores only the default generator (what ``torch.utils.checkpoint`` does) and one that
restores only the tracker fail naming the dropout mask that differs; one that keeps the
activations (no recomputation), one that leaves the restored states behind, a raising one and
the stub fail as such. The reference is the same layers run without recomputation.
"""
import importlib.util
import linecache
import os
import pathlib

from mpu_lab.labkit.device_memory import exercises
from mpu_lab.labkit.grader import grade
from mpu_lab.labkit.notebooks.solutions import solution_source

OWN_SOLUTION = solution_source("03")
LEARNER = OWN_SOLUTION.replace("def solution_checkpoint(", "def my_checkpoint(")

STUB = '''
def my_checkpoint(function, distribute_saved_activations, *args):
    raise NotImplementedError("save the RNG states, run function without grad, ...")
'''

# the solution, with the restores taken out one at a time
NO_RESTORE = LEARNER.replace("            set_states(ctx.states)  ", "            pass  ")
CPU_ONLY = LEARNER.replace("        get_rng_tracker().set_states(tracker)\n", "")
TRACKER_ONLY = LEARNER.replace("        torch.set_rng_state(cpu)\n", "")
KEEPS_STATES = LEARNER.replace("                set_states(now)  ", "                pass  ")

NO_RECOMPUTE = '''
def my_checkpoint(function, distribute_saved_activations, *args):
    return function(*args)
'''

RAISES = '''
def my_checkpoint(function, distribute_saved_activations, *args):
    return function(args)
'''


def _grade(source, world, as_notebook):
    return grade(as_notebook(source)["my_checkpoint"], exercises.CHECKPOINT, world)


def test_the_solution_passes_and_is_saved_as_megatrons_checkpoint(grading_world, as_notebook,
                                                                  capsys):
    # IPython keeps a cell's text in linecache, which is where the grader reads what it saves
    linecache.cache["<learner cell>"] = (len(OWN_SOLUTION), None,
                                         OWN_SOLUTION.splitlines(keepends=True), "<learner cell>")
    assert grade(as_notebook(OWN_SOLUTION)["solution_checkpoint"], exercises.CHECKPOINT,
                 grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: solution_checkpoint agrees with the reference on all 4 ranks "
                          "for 3 inputs: one layer, dropout 0.5"), out
    assert "saved: my_megatron/random.py (checkpoint)" in out
    saved = pathlib.Path(os.environ["MPU_LAB_MY_MEGATRON"]) / "random.py"
    spec = importlib.util.spec_from_file_location("learner_random", saved)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(module.checkpoint)


def test_no_restore_fails_naming_the_tracker_streams_mask(grading_world, as_notebook, capsys):
    assert NO_RESTORE != LEARNER
    assert not _grade(NO_RESTORE, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 0, input 'one layer, dropout 0.5, s=4 b=2 h=8': "
                          "tensor-parallel rank 0 of 2: layer 0: the tracker-stream dropout "
                          "(inside the tensor-parallel region)'s mask expected the forward's "
                          "mask, drawn again in the recomputation, got a different mask ("), out
    assert "Hint: forward: remember the random states" in out


def test_restoring_only_the_default_generator_names_the_tracker_mask(grading_world,
                                                                     as_notebook, capsys):
    assert CPU_ONLY != LEARNER
    assert not _grade(CPU_ONLY, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert "the tracker-stream dropout (inside the tensor-parallel region)'s mask" in out, out


def test_restoring_only_the_tracker_names_the_default_generators_mask(grading_world,
                                                                       as_notebook, capsys):
    assert TRACKER_ONLY != LEARNER
    assert not _grade(TRACKER_ONLY, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert "the default-generator dropout (after the all-reduce)'s mask" in out, out


def test_leaving_the_forwards_states_behind_fails_on_the_state_after_backward(
        grading_world, as_notebook, capsys):
    assert KEEPS_STATES != LEARNER
    assert not _grade(KEEPS_STATES, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert "the random states after backward expected those found before the recomputation" \
        in out, out


def test_no_recomputation_fails_on_the_bytes_kept(grading_world, as_notebook, capsys):
    assert not _grade(NO_RECOMPUTE, grading_world, as_notebook)
    out = capsys.readouterr().out
    # the input x alone: s * b * h = 4 * 2 * 8 fp32 values, 4 bytes each
    assert "the bytes autograd kept for backward expected at most the layers' inputs, 256 " \
           "bytes" in out, out


def test_a_raising_checkpoint_shows_the_rank_and_its_error(grading_world, as_notebook, capsys):
    assert not _grade(RAISES, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: on input 'one layer, dropout 0.5, s=4 b=2 h=8' rank 0 "
                          "raised TypeError"), out


def test_the_stub_has_no_answer_yet(grading_world, as_notebook, capsys):
    assert not _grade(STUB, grading_world, as_notebook)
    assert capsys.readouterr().out.startswith("No answer yet: my_checkpoint still raises "
                                              "NotImplementedError")


TORCH_CHECKPOINT = '''
def torch_utils_checkpoint(function, distribute_saved_activations, *args):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)
'''


def test_torch_utils_checkpoint_misses_the_tracker_streams_mask(grading_world, as_notebook,
                                                               capsys):
    """What the lab shows: torch's own checkpoint restores the default generator only."""
    fn = as_notebook(TORCH_CHECKPOINT)["torch_utils_checkpoint"]
    assert not grade(fn, exercises.CHECKPOINT, grading_world)
    out = capsys.readouterr().out
    assert "layer 0: the tracker-stream dropout (inside the tensor-parallel region)'s mask " \
           "expected the forward's mask" in out, out
