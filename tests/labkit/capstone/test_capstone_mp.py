"""The capstone end to end, at TP = 2 x PP = 2 on 4 CPU ranks (torchrun jobs, slow):
labs/solutions trains equal to the mirror (exit 0), and so at TP = 2 x PP = 2 x DP = 2 on 8
ranks; a copy with f's backward all-reduce removed (its forward still right) and without
random.py exits 1 naming f (the gradient norm of the first iteration parts, its loss does not),
and says the checkpoint is the mirror's; lab 18's RowParallelLinear without g (its forward
wrong) exits 1 naming it at the first loss; lab 11's build, the 1F1B loop, stands for the
schedule: right, it trains equal; backing the wrong micro-batch out, it is named. The reference is the mirror's own run from the same
seed in the same job; the mirror itself is held to its dense twins by tests/models and
tests/tensor_parallel."""
import ast
import pathlib
import shutil

import pytest

from documented import COMMANDS, REPO, script_and_flags
from mpu_lab.labkit.capstone import lesson, parse_args, run_capstone
from mpu_lab.labkit.capstone.run import run_checked

pytestmark = pytest.mark.slow
SOLUTIONS = pathlib.Path(__file__).resolve().parents[3] / "labs" / "solutions"
F_BACKWARD = '''    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad)


class _Reduce'''


def test_labs_solutions_trains_equal_to_the_mirror_at_tp2_pp2():
    """The command capstone.py's docstring shows, as written (tests/documented.py; its
    --code, labs/solutions, read from the repository): the reference run."""
    script, flags, nproc = script_and_flags(COMMANDS["capstone.py:1"])
    at = flags.index("--code") + 1
    flags[at] = str(REPO / flags[at])
    assert script == "capstone.py" and pathlib.Path(flags[at]).resolve() == SOLUTIONS
    args = parse_args(flags)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, nproc) == (2, 2, 4)
    result = run_checked(args, echo=False)
    assert result.exit_code == 0, result.lines
    assert result.lines[-1] == "capstone: losses equal the mirror's within 1e-05 over 3 iterations"
    assert "used: layers.py:ColumnParallelLinear x8" in result.lines       # 2 per layer, 4 layers
    assert "used: layers.py:RowParallelLinear x8" in result.lines
    assert not any(line.startswith("missing:") for line in result.lines)
    assert result.learner_losses[-1] < result.learner_losses[0]           # it learns


def test_f_broken_in_its_backward_only_is_named_and_a_missing_piece_is_the_mirrors(tmp_path):
    code = tmp_path / "my_megatron"
    shutil.copytree(SOLUTIONS, code)
    mappings = (code / "mappings.py").read_text()
    assert mappings.count(F_BACKWARD) == 1
    (code / "mappings.py").write_text(mappings.replace(F_BACKWARD, F_BACKWARD.replace(
        "return _all_reduce(grad)", "return grad")))
    (code / "random.py").unlink()
    result = run_capstone(code, 2, 2, train_iters=3, echo=False)
    assert result.exit_code == 1, result.lines
    assert "missing: checkpoint (the mirror's is used)" in result.lines
    # the first loss is forward only: equal; the first backward's gradients are not
    assert result.learner_losses[0] == pytest.approx(result.mirror_losses[0], rel=1e-6)
    assert result.first_parting == (1, "grad_norm")
    assert result.culprit == "mappings.py:copy_to_tensor_model_parallel_region"
    assert result.lines[-1].startswith("capstone: gradient norms part from the mirror's at "
                                       "iteration 1")
    assert "the piece is mappings.py:copy_to_tensor_model_parallel_region" in result.lines[-1]


def test_a_row_parallel_linear_without_g_parts_at_the_first_loss_and_is_named(tmp_path):
    """Lab 18's broken piece: its forward is wrong, so the first loss already differs."""
    code = lesson.write_broken_row_parallel(tmp_path / "broken").parent
    result = run_capstone(code, 2, 2, train_iters=3, echo=False)
    assert result.exit_code == 1, result.lines
    assert result.first_parting == (1, "loss")
    assert result.culprit == "layers.py:RowParallelLinear"
    assert "used: layers.py:RowParallelLinear x8" in result.lines     # 2 per layer, 4 layers
    assert result.lines[-1].startswith("capstone: losses part from the mirror's at iteration 1")
    assert "the piece is layers.py:RowParallelLinear" in result.lines[-1]
    # the lesson's order of the pieces is the job's: one line each, in that order
    assert [line.split()[1].split(":")[-1] for line in result.lines[:-1]] == \
        [name for _, name, _ in lesson.PIECES]


def test_labs_solutions_trains_equal_to_the_mirror_at_tp2_pp2_dp2_on_8_ranks():
    result = run_capstone(SOLUTIONS, 2, 2, data_parallel_size=2, train_iters=3, echo=False)
    assert result.exit_code == 0, result.lines
    assert result.lines[-1] == "capstone: losses equal the mirror's within 1e-05 over 3 iterations"
    # one copy of the model counted: the other data-parallel copy is not counted again
    assert "used: layers.py:RowParallelLinear x8" in result.lines
    assert "used: distributed_data_parallel.py:DistributedDataParallel x2" in result.lines


def _lab11_loop(broken=False):
    """schedules.py as lab 11's grader saves a right ``my_1f1b_loop``: the solution's loop under
    the learner's name; ``broken``: each backward takes the newest micro-batch in flight
    instead of the oldest (its forwards and messages right)."""
    source = (SOLUTIONS / "11_pipeline_parallel.py").read_text()
    node = next(n for n in ast.parse(source).body
                if isinstance(n, ast.FunctionDef) and n.name == "solution_1f1b_loop")
    loop = ast.get_source_segment(source, node).replace("solution_1f1b_loop", "my_1f1b_loop")
    if broken:
        assert loop.count("inputs.pop(0), outputs.pop(0)") == 2
        loop = loop.replace("inputs.pop(0), outputs.pop(0)", "inputs.pop(), outputs.pop()")
    return loop + "\n"


@pytest.mark.parametrize("broken", [False, True], ids=["right", "newest-first"])
def test_lab_11s_loop_stands_for_the_schedule(tmp_path, broken):
    code = tmp_path / "my_megatron"
    code.mkdir()
    (code / "schedules.py").write_text(_lab11_loop(broken))
    result = run_capstone(code, 1, 2, train_iters=2, echo=False)
    line = ("used: schedules.py:my_1f1b_loop x2 "      # once per iteration on each of 2 stages
            "(as forward_backward_pipelining_without_interleaving)")
    assert line in result.lines, result.lines
    if not broken:
        assert result.exit_code == 0, result.lines
        assert result.learner_losses == pytest.approx(result.mirror_losses, rel=1e-6)
        return
    assert result.exit_code == 1, result.lines
    # stage 0 holds two micro-batches: the first loss is forward only, its gradients are not
    assert result.first_parting == (1, "grad_norm")
    assert result.culprit == "schedules.py:my_1f1b_loop"
