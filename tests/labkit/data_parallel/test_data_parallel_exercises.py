"""Lab 04's checks and its write-the-code exercise, on the shared 4-rank grading world
(tp = 2, so the data-parallel groups are [0, 2] and [1, 3]: d = 2, not the world's 4).

* ``DISTRIBUTED_STEP`` (the distributed optimizer's step on one flat buffer): the lab's
  solution passes (reduce-scatter, shard update, all-gather, padding for sizes d does not
  divide); the plain all-reduce step has the right values but the wrong collectives and fails
  naming them; a step that sums instead of averaging, one that divides by the world's size
  instead of the group's, and one that does not pad fail naming the rank and the input; the
  stub has no answer yet.
* ``BUCKET_HOOK`` (the hook that starts a bucket's all-reduce once it is ready), its all-reduces
  seen from outside (torch's CommDebugMode, :mod:`mpu_lab.labkit.c10d_calls`): the
  solution passes; a bucket started before its micro-batches are in, a synchronous all-reduce,
  one all-reduce per parameter and an all-reduce of a copy of the bucket (``comm``'s) each fail
  naming what was wrong; the stub has no answer yet.
* The predictions: the optimizer-state bytes per rank and the ring all-reduce's bytes against
  values worked by hand (12 bytes per parameter over d ranks; 2 (d - 1) / d of the array).
"""
import pytest

from mpu_lab import perf
from mpu_lab.labkit.data_parallel import lessons as dp_lessons
from mpu_lab.labkit.grader import grade
from mpu_lab.labkit.data_parallel import exercises as data_parallel
from mpu_lab.labkit.notebooks.solutions import solution_source

# The lab's solution, as labs/solutions/ holds it (the learner loads it with %load): it must pass
# under its own name, and the verdict must name it, not the learner's function.
OWN_SOLUTION = solution_source("04")

STUB = '''
def my_distributed_step(param, grad, lr, group):
    raise NotImplementedError("reduce-scatter the gradient, update your shard, all-gather")
'''

SOLUTION = '''
def my_distributed_step(param, grad, lr, group):
    d, me = dist.get_world_size(group), dist.get_rank(group)
    n = param.numel()
    size = -(-n // d)                                  # shard length, after padding
    pad = torch.zeros(size * d - n, dtype=grad.dtype, device=grad.device)
    shard_grad = torch.empty(size, dtype=grad.dtype, device=grad.device)
    dist.reduce_scatter_tensor(shard_grad, torch.cat([grad, pad]), group=group)
    shard = torch.cat([param, pad])[me * size:(me + 1) * size] - lr * shard_grad / d
    full = torch.empty(size * d, dtype=param.dtype, device=param.device)
    dist.all_gather_into_tensor(full, shard, group=group)
    return full[:n]
'''

# the same with mpu_lab.core.comm's collectives, which return new tensors
COMM_SOLUTION = '''
def my_distributed_step(param, grad, lr, group):
    d, me = dist.get_world_size(group), dist.get_rank(group)
    n = param.numel()
    size = -(-n // d)
    pad = torch.zeros(size * d - n, dtype=grad.dtype, device=grad.device)
    shard_grad = comm.reduce_scatter(torch.cat([grad, pad]), group) / d
    shard = torch.cat([param, pad])[me * size:(me + 1) * size] - lr * shard_grad
    return comm.all_gather(shard, group)[:n]
'''

ALL_REDUCE = '''
def my_distributed_step(param, grad, lr, group):
    g = grad.clone()
    dist.all_reduce(g, group=group)
    return param - lr * g / dist.get_world_size(group)
'''

NO_AVERAGE = SOLUTION.replace("- lr * shard_grad / d", "- lr * shard_grad")
WORLD_SIZE = SOLUTION.replace("- lr * shard_grad / d", "- lr * shard_grad / dist.get_world_size()")
NO_PADDING = '''
def my_distributed_step(param, grad, lr, group):
    d, me = dist.get_world_size(group), dist.get_rank(group)
    size = param.numel() // d
    shard_grad = torch.empty(size, dtype=grad.dtype, device=grad.device)
    dist.reduce_scatter_tensor(shard_grad, grad, group=group)
    shard = param[me * size:(me + 1) * size] - lr * shard_grad / d
    full = torch.empty(size * d, dtype=param.dtype, device=param.device)
    dist.all_gather_into_tensor(full, shard, group=group)
    return full
'''


def _grade(source, world, as_notebook):
    return grade(as_notebook(source)["my_distributed_step"], data_parallel.DISTRIBUTED_STEP, world)


def test_the_solution_passes_on_every_rank(grading_world, as_notebook, capsys):
    assert grade(as_notebook(OWN_SOLUTION)["solution_distributed_step"],
                 data_parallel.DISTRIBUTED_STEP, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: solution_distributed_step agrees with the reference on all 4 "
                          "ranks "
                          "for 4 inputs: 8 parameters, lr 0.1; 11 parameters (pad"), out


def test_the_solution_with_mpu_lab_comm_passes(grading_world, as_notebook, capsys):
    assert _grade(COMM_SOLUTION, grading_world, as_notebook)
    assert capsys.readouterr().out.startswith("Right:")


def test_the_plain_all_reduce_has_the_right_values_but_the_wrong_collectives(
        grading_world, as_notebook, capsys):
    assert not _grade(ALL_REDUCE, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 0, input '8 parameters, lr 0.1': data-parallel rank 0 "
                          "of 2: the collectives called (the values were right) expected a "
                          "reduce-scatter of the gradient and an all-gather of the parameters, "
                          "no all-reduce, got all-reduce."), out
    assert "Hint: pad the gradient" in out


@pytest.mark.parametrize("source", [NO_AVERAGE, WORLD_SIZE], ids=["sum", "world size"])
def test_a_wrong_average_names_the_rank_and_the_input(source, grading_world, as_notebook,
                                                      capsys):
    assert not _grade(source, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 0, input '8 parameters, lr 0.1': data-parallel rank 0 "
                          "of 2: the updated parameters expected shape (8,) ["), out
    assert ", got shape (8,) [" in out


def test_without_padding_a_size_d_does_not_divide_fails(grading_world, as_notebook, capsys):
    assert not _grade(NO_PADDING, grading_world, as_notebook)
    out = capsys.readouterr().out
    # 8 splits over d = 2, 11 does not: the first input that needs padding fails
    assert "input '11 parameters (pad to a multiple of d)'" in out, out
    assert out.startswith("Not yet:")
    assert grading_world.run("x = torch.ones(1); dist.all_reduce(x); x.item()") == [4.0] * 4


def test_the_stub_has_no_answer_yet(grading_world, as_notebook, capsys):
    assert not _grade(STUB, grading_world, as_notebook)
    assert capsys.readouterr().out.startswith(
        "No answer yet: my_distributed_step still raises NotImplementedError")


def test_step_inputs_share_the_parameters_and_not_the_gradients():
    p0, g0 = data_parallel.step_inputs(5, seed=3, rank=0)
    p1, g1 = data_parallel.step_inputs(5, seed=3, rank=1)
    assert p0.tolist() == p1.tolist()
    assert g0.tolist() != g1.tolist()


def test_optimizer_state_per_rank_worked_by_hand(capsys):
    # 1.2e9 parameters x 12 bytes (fp32 weight, m, v) = 14.4 GB; over d = 4: 3.6 GB
    assert data_parallel.check_optimizer_state_gb(3.6, 1.2e9, 4)
    assert capsys.readouterr().out.startswith("Right: 3.6 GB per rank")
    assert data_parallel.check_optimizer_state_gb(14.4, 1.2e9, 4, distributed_optimizer=False)
    capsys.readouterr()
    assert not data_parallel.check_optimizer_state_gb(14.4, 1.2e9, 4)
    assert "Hint:" in capsys.readouterr().out
    assert not data_parallel.check_optimizer_state_gb(4.8, 1.2e9, 4)    # 16 bytes / 4: not the state
    capsys.readouterr()
    assert not data_parallel.check_optimizer_state_gb(None, 1.2e9, 4)
    assert capsys.readouterr().out.startswith("No answer yet")
    # fp32 weights and gradients (mpu_lab's own): Adam's m and v only, 4 + 4 bytes
    assert data_parallel.optimizer_state_bytes(1000, 2, True, "fp32", "fp32") == 4000
    # fp16 weights and gradients: fp32 main weight and main gradient too, 4 x 4 = 16 bytes
    assert data_parallel.optimizer_state_bytes(1000, 4, True, "fp16", "fp16") == 4000
    assert data_parallel.check_optimizer_state_gb(4.8, 1.2e9, 4, params_dtype="fp16", grads_dtype="fp16")
    assert capsys.readouterr().out.startswith(
        "Right: 4.8 GB per rank: 16 bytes per parameter (4 fp32 main param + 4 fp32 main grad "
        "+ 4 Adam m + 4 Adam v) x 1,200,000,000 parameters / d = 4.")
    with pytest.raises(ValueError, match="d must be a whole number >= 1, got 0"):
        data_parallel.optimizer_state_bytes(10, 0, True)


# --------------------------------------------------------------------------- the lab's lessons
def test_the_toy_buffer_layout_worked_by_hand(capsys):
    """p0..p4 of 6, 3, 10, 5, 7 elements, reversed: p4 p3 | p2 p1 | p0; a bucket closes once
    it holds 12 elements or more; each is padded to a multiple of d = 4."""
    dp_lessons.print_toy_layout([6, 3, 10, 5, 7], d=4, bucket_size=12)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "3 buckets, 31 elements + 5 of padding = 36"
    assert lines[2] == "bucket 0: p4 [0, 7), p3 [7, 12), padding 0 -> 12 elements"
    assert lines[3].startswith("  shards (in the bucket) r0:[0, 3) r1:[3, 6)")
    assert lines[4] == "bucket 1: p2 [12, 22), p1 [22, 25), padding 3 -> 16 elements"
    assert lines[6] == "bucket 2: p0 [28, 34), padding 2 -> 8 elements"
    assert lines[7] == "  shards (in the bucket) r0:[0, 2) r1:[2, 4) r2:[4, 6) r3:[6, 8)"
    assert max(map(len, lines)) <= 100


def test_the_critical_batch_trade_off_worked_by_hand():
    """McCandlish et al. 2018: S = S_min (1 + B_crit / B), E = E_min (1 + B / B_crit): at
    B = B_crit twice the minimum of each; at 4 B_crit 1.25 S_min and 5 E_min."""
    at_crit, four = dp_lessons.critical_batch_rows([1, 4])
    assert (at_crit["steps"], at_crit["samples"]) == (2, 2)
    assert (four["steps"], four["samples"]) == (1.25, 5)


def test_every_configuration_that_fits_still_fits_with_the_distributed_optimizer():
    model = perf.ModelShape(num_layers=48, hidden_size=8192, num_attention_heads=64,
                            seq_length=2048, vocab_size=51200)
    cluster = perf.DGX_A100_80GB.replace(num_nodes=8)
    counts = dp_lessons.fit_counts(model, cluster, 64, 512)
    plain = {(c.config.tp, c.config.pp, c.config.b): c.fits
             for c in perf.explore(model, cluster, 64, 512).candidates}
    sharded = {(c.config.tp, c.config.pp, c.config.b): c.fits
               for c in perf.explore(model, cluster, 64, 512,
                                     distributed_optimizer=True).candidates}
    assert all(sharded[k] for k, fits in plain.items() if fits)
    assert counts[False][0] == sum(plain.values()) < counts[True][0] == sum(sharded.values())


# --------------------------------------------------------------------------- the bucket hook
HOOK_STUB = '''
def my_grad_ready_hook(param, state):
    raise NotImplementedError("start a bucket's all-reduce once it is ready")
'''
HOOK = '''
def my_grad_ready_hook(param, state):
    state.counts[param] += 1
    bucket = state.bucket_of(param)
    if all(state.counts[p] == state.num_micro_batches for p in bucket.params):
        state.pending[bucket.index] = dist.all_reduce(bucket.grad_data, group=state.group,
                                                      async_op=True)
'''
# starts a bucket once each parameter has one gradient: right without accumulation only
HOOK_TOO_EARLY = HOOK.replace("== state.num_micro_batches", ">= 1").replace(
    "    if all(", "    if bucket.index not in state.pending and all(")
HOOK_SYNC = HOOK.replace(",\n                                                      async_op=True)",
                         ")")
HOOK_PER_PARAM = '''
def my_grad_ready_hook(param, state):
    state.counts[param] += 1
    if state.counts[param] == state.num_micro_batches:
        state.pending[id(param)] = dist.all_reduce(param.main_grad, group=state.group,
                                                   async_op=True)
'''

# mpu_lab.core.comm's all-reduce reduces a copy of the bucket and returns it: nothing lands in
# grad_data
HOOK_COMM_COPY = HOOK.replace("dist.all_reduce(bucket.grad_data, group=state.group,\n"
                              "                                                      async_op=True)",
                              "comm.all_reduce_async(bucket.grad_data, state.group)")


def _grade_hook(source, world, as_notebook):
    return grade(as_notebook(source)["my_grad_ready_hook"], data_parallel.BUCKET_HOOK, world)


def test_the_hook_solution_passes_under_its_own_name(grading_world, as_notebook, capsys):
    assert grade(as_notebook(OWN_SOLUTION)["solution_grad_ready_hook"],
                 data_parallel.BUCKET_HOOK, grading_world)
    out = capsys.readouterr().out
    assert out.startswith("Right: solution_grad_ready_hook agrees with the reference on all 4 "
                          "ranks for 4 inputs: one bucket, 1 micro-batch;"), out


def test_a_hook_written_in_the_notebook_passes(grading_world, as_notebook, capsys):
    assert _grade_hook(HOOK, grading_world, as_notebook)
    assert capsys.readouterr().out.startswith("Right: my_grad_ready_hook agrees")


def test_a_bucket_started_before_its_micro_batches_are_in_fails_naming_it(
        grading_world, as_notebook, capsys):
    assert not _grade_hook(HOOK_TOO_EARLY, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 0, input 'buckets of about 40 elements, 2 "
                          "micro-batches': data-parallel rank 0 of 2: the all-reduces your hook "
                          "started expected one asynchronous all-reduce per bucket"), out
    assert "got bucket 0 started when one of its parameters had 1 of its 2 gradient(s)." in out


def test_a_synchronous_all_reduce_fails_saying_backward_waited(grading_world, as_notebook,
                                                               capsys):
    assert not _grade_hook(HOOK_SYNC, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert "got bucket 0's all-reduce with async_op=False: backward stood still" in out, out


def test_one_all_reduce_per_parameter_fails_naming_the_tensor(grading_world, as_notebook,
                                                              capsys):
    assert not _grade_hook(HOOK_PER_PARAM, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert "which is not a bucket's grad_data" in out, out
    assert grading_world.run("x = torch.ones(1); dist.all_reduce(x); x.item()") == [4.0] * 4


def test_reducing_a_copy_of_the_bucket_fails_naming_it(grading_world, as_notebook, capsys):
    assert "comm.all_reduce_async(bucket.grad_data, state.group)" in HOOK_COMM_COPY
    assert not _grade_hook(HOOK_COMM_COPY, grading_world, as_notebook)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 0, input 'one bucket, 1 micro-batch': data-parallel "
                          "rank 0 of 2: the all-reduces your hook started expected one "
                          "asynchronous all-reduce per bucket"), out
    assert ("got an all-reduce of a copy of bucket 0's grad_data (what mpu_lab.core.comm "
            "reduces): the sum never reaches the bucket.") in out, out


def test_the_hook_stub_has_no_answer_yet(grading_world, as_notebook, capsys):
    assert not _grade_hook(HOOK_STUB, grading_world, as_notebook)
    assert capsys.readouterr().out.startswith(
        "No answer yet: my_grad_ready_hook still raises NotImplementedError")
