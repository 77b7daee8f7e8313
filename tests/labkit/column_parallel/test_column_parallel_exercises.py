"""Lab 06 on a live 4-rank world (tp = 2, dp = 2; the session's ``grading_world``): the
write-the-code exercise ``my_column_forward`` (the solution passes; forgetting the gather,
gathering rows, leaving out f and the stub each get their verdict), the RNG streams the lab
teaches (default stream the same on every rank, tensor-parallel stream seed + 2718 + tp rank),
where a shard's first numbers come from, and the fused-weight layouts of the stride section."""
import pytest

from mpu_lab.labkit import grader
from mpu_lab.labkit.column_parallel import exercises as column_parallel
from mpu_lab.labkit.column_parallel import viz as splits
from mpu_lab.labkit.notebooks.solutions import solution_source

# The lab's solution, as labs/solutions/ holds it (the learner loads it with %load): it must pass
# under its own name, and the verdict must name it, not the learner's function.
OWN_SOLUTION = solution_source("06")

# A right answer as a learner writes it.
SOLUTION = '''
def my_column_forward(x, weight_shard, bias_shard, gather_output):
    x = copy_to_tensor_model_parallel_region(x)               # f
    y_i = torch.matmul(x, weight_shard.t()) + bias_shard      # Y_i = X A_i + b_i
    if gather_output:
        return gather_from_tensor_model_parallel_region(y_i)  # [..., out]
    return y_i
'''

STUB = '''
def my_column_forward(x, weight_shard, bias_shard, gather_output):
    raise NotImplementedError("f, then Y_i = X A_i + b_i, then the gather")
'''

# Plausible wrong answers.
NO_GATHER = '''
def my_column_forward(x, weight_shard, bias_shard, gather_output):
    x = copy_to_tensor_model_parallel_region(x)
    return torch.nn.functional.linear(x, weight_shard, bias_shard)
'''

GATHERS_ROWS = '''
def my_column_forward(x, weight_shard, bias_shard, gather_output):
    x = copy_to_tensor_model_parallel_region(x)
    y_i = torch.nn.functional.linear(x, weight_shard, bias_shard)
    if not gather_output:
        return y_i
    group = parallel_state.get_tensor_model_parallel_group()
    blocks = [torch.empty_like(y_i) for _ in range(dist.get_world_size(group))]
    dist.all_gather(blocks, y_i.contiguous(), group=group)
    return torch.cat(blocks, dim=0)          # stacks the blocks as rows
'''

NO_F = '''
def my_column_forward(x, weight_shard, bias_shard, gather_output):
    y_i = torch.nn.functional.linear(x, weight_shard, bias_shard)
    return gather_from_tensor_model_parallel_region(y_i) if gather_output else y_i
'''

FIRST_CASE = column_parallel.COLUMN_FORWARD.cases[0].name


def _grade(source, world, as_notebook):
    return grader.grade(as_notebook(source)["my_column_forward"], column_parallel.COLUMN_FORWARD, world)


def test_column_forward_solution_passes_every_case(grading_world, as_notebook, capsys):
    solution = as_notebook(OWN_SOLUTION)["solution_column_forward"]
    assert grader.grade(solution, column_parallel.COLUMN_FORWARD, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: solution_column_forward agrees with the reference on all 4 "
                          "ranks")
    assert all(case.name in out for case in column_parallel.COLUMN_FORWARD.cases)


def test_a_right_answer_under_the_learners_name_passes(grading_world, as_notebook, capsys):
    assert _grade(SOLUTION, grading_world, as_notebook)
    assert capsys.readouterr().out.startswith("Right: my_column_forward agrees")


def test_forgetting_the_gather_is_a_shape_on_rank_0(grading_world, as_notebook, capsys):
    assert not _grade(NO_GATHER, grading_world, as_notebook)
    out = capsys.readouterr().out
    # the walkthrough's A [1024, 512]: each of the t = 2 ranks holds 256 columns
    assert out.startswith(f"Not yet: rank 0, input '{FIRST_CASE}': Y (forward) expected shape "
                          f"(4, 512), got shape (4, 256).")
    assert "Hint:" in out and "LAST dimension" in out


def test_gathering_the_blocks_as_rows_is_wrong(grading_world, as_notebook, capsys):
    assert not _grade(GATHERS_ROWS, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert f"rank 0, input '{FIRST_CASE}': Y (forward) expected shape (4, 512), got shape " \
           f"(8, 256)" in out


def test_leaving_out_f_gets_the_forward_right_and_x_grad_wrong(grading_world, as_notebook,
                                                              capsys):
    assert not _grade(NO_F, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith(f"Not yet: rank 0, input '{FIRST_CASE}': x.grad (backward) expected "
                          f"shape (4, 1024) [")
    expected, got = out.split("expected ", 1)[1].split(", got ", 1)
    assert expected.split("[")[1] != got.split("[")[1]      # different numbers, same shape


def test_the_stub_says_no_answer_yet(grading_world, as_notebook, capsys):
    assert not _grade(STUB, grading_world, as_notebook)
    assert capsys.readouterr().out.startswith("No answer yet: my_column_forward still raises "
                                              "NotImplementedError")


def test_a_tensor_parallel_size_that_does_not_divide_512_is_refused():
    assert column_parallel.COLUMN_FORWARD.ranks_needed(3, 3, 1) is not None
    assert "tp = 3 does not divide 512" in column_parallel.COLUMN_FORWARD.ranks_needed(3, 3, 1)
    assert all(column_parallel.COLUMN_FORWARD.ranks_needed(8, t, 1) is None for t in (1, 2, 4, 8))


# --------------------------------------------------------------------------- the RNG tracker
# Runs on every rank (sent as a notebook's function is): the masks the lab's RNG cells draw,
# and the same masks again from fresh generators seeded as Megatron seeds them. The rank's
# generators and streams are put back afterwards (the world is shared).
DROPOUT_MASKS = '''
def dropout_masks(seed):
    saved_cpu, saved_streams = torch.get_rng_state(), tensor_parallel.get_rng_tracker().get_states()
    tensor_parallel.model_parallel_manual_seed(seed)
    ones = torch.ones(64, device=device)
    outside = torch.nn.functional.dropout(ones, p=0.5)
    with tensor_parallel.get_rng_tracker().fork():
        inside = torch.nn.functional.dropout(ones, p=0.5)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    torch.manual_seed(seed)
    fresh_outside = torch.nn.functional.dropout(ones, p=0.5)
    torch.manual_seed(seed + 2718 + tp_rank)
    fresh_inside = torch.nn.functional.dropout(ones, p=0.5)
    torch.set_rng_state(saved_cpu)
    tensor_parallel.get_rng_tracker().set_states(saved_streams)
    return {"tp_rank": tp_rank, "dp_rank": parallel_state.get_data_parallel_rank(),
            "outside": (outside > 0).tolist(), "inside": (inside > 0).tolist(),
            "fresh_outside": (fresh_outside > 0).tolist(), "fresh_inside": (fresh_inside > 0).tolist()}
'''


def test_dropout_masks_agree_outside_the_fork_and_differ_across_tp_ranks_inside(
        grading_world, as_notebook):
    got = grading_world.run(as_notebook(DROPOUT_MASKS)["dropout_masks"], 1234)
    # grading_world: tp = 2, dp = 2, Megatron's order: TP groups [0, 1], [2, 3]
    assert [(g["tp_rank"], g["dp_rank"]) for g in got] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # outside: the default stream, seeded with the same seed on every rank
    assert all(g["outside"] == got[0]["outside"] for g in got)
    assert all(g["outside"] == g["fresh_outside"] for g in got)
    # inside: seed + 2718 + tp rank: different across a TP group, the same across DP replicas
    assert all(g["inside"] == g["fresh_inside"] for g in got)
    assert got[0]["inside"] != got[1]["inside"] and got[2]["inside"] != got[3]["inside"]
    assert got[0]["inside"] == got[2]["inside"] and got[1]["inside"] == got[3]["inside"]
    # and the streams are not the same stream: inside differs from outside
    assert got[0]["inside"] != got[0]["outside"]


def test_a_shard_drawn_in_the_fork_is_not_the_single_gpu_weight_but_mpu_labs_slice_is(
        grading_world):
    got = grading_world.run(column_parallel.shard_init_matches_single_gpu, 1234)
    assert [g["mpu_lab"] for g in got] == [True] * 4
    # tensor-parallel rank 1 draws from seed + 2718 + 1, a stream a single GPU never has
    assert got[1]["megatron_default"] is False and got[3]["megatron_default"] is False


# --------------------------------------------------------------------------- fused layouts
def test_head_grouped_qkv_gives_whole_heads_without_a_stride(capsys):
    # Megatron-core's linear_qkv: [q0; k0; v0; q1; k1; v1] -> rank r holds head r
    splits.print_rows_kept(splits.fused_row_labels("qkv by head", blocks=2, rows=1), tp=2)
    assert capsys.readouterr().out.splitlines() == ["rank 0 keeps: q0 k0 v0",
                                                    "rank 1 keeps: q1 k1 v1"]


def test_block_layouts_need_the_stride(capsys):
    legacy = splits.fused_row_labels("qkv blocks", blocks=2, rows=1)
    assert legacy == ["q0", "q1", "k0", "k1", "v0", "v1"]
    splits.print_rows_kept(legacy, tp=2)                 # a contiguous cut: all of Q on rank 0
    splits.print_rows_kept(legacy, tp=2, stride=3)
    glu = splits.fused_row_labels("gate-up blocks", blocks=4, rows=1)
    splits.print_rows_kept(glu, tp=2, stride=2)
    assert capsys.readouterr().out.splitlines() == [
        "rank 0 keeps: q0 q1 k0", "rank 1 keeps: k1 v0 v1",
        "rank 0 keeps: q0 k0 v0", "rank 1 keeps: q1 k1 v1",
        "rank 0 keeps: g0 g1 u0 u1", "rank 1 keeps: g2 g3 u2 u3"]


def test_fused_layout_and_figure_arguments_are_checked():
    with pytest.raises(ValueError, match="layout must be one of"):
        splits.fused_row_labels("kqv")
    with pytest.raises(ValueError, match="blocks and rows must be at least 1"):
        splits.fused_row_labels("qkv by head", blocks=0)
    with pytest.raises(ValueError, match="names the 3 fused parts"):
        splits.plot_column_split(1024, 768, 2, stride=3, part_names=["gate", "up"])
    assert splits.plot_column_split(1024, 1536, 8, stride=3).axes


def test_the_walkthroughs_master_weight_slips_shown_on_tensors(capsys):
    # worked by hand: 512 rows cut 16 ways by [gp::16] take every 16th row; Megatron's
    # torch.split(.., 256) at t = 2 takes rows 0-255 and 256-511
    got = column_parallel.print_walkthrough_master_weight()
    assert got["empty_draws_nothing"] is True
    assert got["interleaved_rows"][0] == list(range(0, 512, 16))
    assert got["interleaved_rows"][1] == list(range(1, 512, 16))
    assert got["block_rows"] == [list(range(256)), list(range(256, 512))]
    # interleaved shards gather into XA with its columns out of order; blocks into XA itself
    assert got["interleaved_gathers_to_dense"] is False and got["blocks_gather_to_dense"] is True
    out = capsys.readouterr().out
    assert "master_weight[0::16]: rows 0, 16, 32, ..., 496 (32 rows)" in out
    assert "torch.split(master_weight, 256)[1]: rows 256, 257, 258, ..., 511 (256 rows)" in out
