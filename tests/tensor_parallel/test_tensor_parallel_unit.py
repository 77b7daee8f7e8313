"""mpu_lab.core.tensor_parallel in one process: pure helpers, error messages, and a world of one
rank (gloo over an in-memory store) where every layer must equal its plain torch twin."""
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpu_lab.core import parallel_state as ps
from mpu_lab.core import tensor_parallel as tp
from mpu_lab.perf.comm_counts import CollectiveLog
from mpu_lab.core.tensor_parallel import mappings


# --- pure helpers -------------------------------------------------------------------------
def test_divide_returns_exact_quotient():
    assert tp.divide(512, 16) == 32
    assert tp.divide(1024, 2) == 512


def test_divide_and_ensure_divisibility_name_the_numbers():
    with pytest.raises(ValueError, match="500 is not divisible by 16"):
        tp.divide(500, 16)
    with pytest.raises(ValueError, match="7 is not divisible by 0"):
        tp.ensure_divisibility(7, 0)
    tp.ensure_divisibility(12, 3)


def test_split_tensor_along_last_dim_gives_equal_views():
    x = torch.arange(24.0).view(2, 12)
    parts = tp.split_tensor_along_last_dim(x, 3)
    assert [tuple(p.shape) for p in parts] == [(2, 4)] * 3
    assert torch.equal(torch.cat(parts, dim=-1), x)
    assert parts[1].data_ptr() == x[:, 4:].data_ptr()          # views, no copy
    contiguous = tp.split_tensor_along_last_dim(x, 3, contiguous_split_chunks=True)
    assert all(p.is_contiguous() for p in contiguous)


def test_split_tensor_along_last_dim_rejects_uneven_split():
    with pytest.raises(ValueError, match="12 is not divisible by 5"):
        tp.split_tensor_along_last_dim(torch.zeros(2, 12), 5)


@pytest.mark.parametrize("rank, expected", [(0, (0, 250)), (1, (250, 500)), (3, (750, 1000))])
def test_vocab_range_from_global_vocab_size(rank, expected):
    assert tp.VocabUtility.vocab_range_from_global_vocab_size(1000, rank, 4) == expected
    assert tp.VocabUtility.vocab_range_from_per_partition_vocab_size(250, rank, 4) == expected


def test_vocab_range_rejects_vocab_not_divisible_by_tp():
    with pytest.raises(ValueError, match="1001 is not divisible by 4"):
        tp.VocabUtility.vocab_range_from_global_vocab_size(1001, 0, 4)


def test_public_api_names_exist():
    for name in ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
                 "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
                 "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
                 "reduce_scatter_to_sequence_parallel_region", "ColumnParallelLinear",
                 "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
                 "broadcast_data", "split_tensor_along_last_dim", "split_tensor_into_1d_equal_chunks",
                 "gather_split_1d_tensor", "VocabUtility", "model_parallel_manual_seed",
                 "get_rng_tracker", "set_tensor_model_parallel_attributes"):
        assert hasattr(tp, name), name
    assert tp.model_parallel_cuda_manual_seed is tp.model_parallel_manual_seed
    for cls in ("_CopyToModelParallelRegion", "_ReduceFromModelParallelRegion",
                "_ScatterToModelParallelRegion", "_GatherFromModelParallelRegion",
                "_ScatterToSequenceParallelRegion", "_GatherFromSequenceParallelRegion",
                "_ReduceScatterToSequenceParallelRegion"):
        assert issubclass(getattr(mappings, cls), torch.autograd.Function), cls


def test_layers_raise_clear_error_before_initialize_model_parallel(monkeypatch):
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: False)
    for build in (lambda: tp.ColumnParallelLinear(8, 8), lambda: tp.RowParallelLinear(8, 8),
                  lambda: tp.VocabParallelEmbedding(8, 4)):
        with pytest.raises(RuntimeError, match="initialize_model_parallel"):
            build()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        tp.model_parallel_manual_seed(1)


def test_set_tensor_model_parallel_attributes_sets_and_refuses_twice():
    p = torch.nn.Parameter(torch.zeros(2))
    tp.set_tensor_model_parallel_attributes(p, True, 0, 3)
    assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (True, 0, 3)
    with pytest.raises(ValueError, match="tensor_model_parallel"):
        tp.set_tensor_model_parallel_attributes(p, False, 1, 1)
    q = torch.nn.Parameter(torch.zeros(2))
    tp.set_defaults_if_not_set_tensor_model_parallel_attributes(q)
    assert (q.tensor_model_parallel, q.partition_dim, q.partition_stride) == (False, -1, 1)


# --- a world of one rank ------------------------------------------------------------------
@pytest.fixture(scope="module")
def world_of_one():
    """gloo with a single rank and tp=pp=1: real groups, no other process."""
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        created = True
    elif dist.get_world_size() != 1:
        pytest.skip("a multi-rank process group is already running in this process")
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


@pytest.fixture
def tp4(monkeypatch, world_of_one):
    """Pretend to be tensor-parallel rank 1 of 4: only for errors raised before communication."""
    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 4)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 1)


def test_sizes_not_divisible_by_tp_raise_value_error_naming_numbers(tp4):
    with pytest.raises(ValueError, match="output_size 30 is not divisible by the tensor-parallel size 4"):
        tp.ColumnParallelLinear(16, 30)
    with pytest.raises(ValueError, match="input_size 30 is not divisible by the tensor-parallel size 4"):
        tp.RowParallelLinear(30, 16)
    with pytest.raises(ValueError, match="num_embeddings .* 50 is not divisible by the tensor-parallel size 4"):
        tp.VocabParallelEmbedding(50, 8)


def test_stride_must_divide_the_partition(tp4):
    with pytest.raises(ValueError, match="stride 3"):
        tp.ColumnParallelLinear(16, 32, stride=3)


def test_tp4_shard_is_rank1_slice_of_master_not_world_slice(tp4):
    torch.manual_seed(0)
    col = tp.ColumnParallelLinear(6, 8, keep_master_weight_for_test=True)
    assert torch.equal(col.weight, col.master_weight[2:4])     # rank 1 of 4: rows [2, 4)
    torch.manual_seed(0)
    row = tp.RowParallelLinear(8, 6, keep_master_weight_for_test=True)
    assert torch.equal(row.weight, row.master_weight[:, 2:4])


def test_sequence_parallel_flag_conflicts_raise(world_of_one):
    with pytest.raises(ValueError, match="gather_output"):
        tp.ColumnParallelLinear(8, 8, gather_output=True, sequence_parallel=True)
    with pytest.raises(ValueError, match="input_is_parallel"):
        tp.RowParallelLinear(8, 8, input_is_parallel=False, sequence_parallel=True)


def test_mappings_communicate_nothing_on_a_group_of_one(world_of_one):
    x = torch.randn(4, 6, requires_grad=True)
    with CollectiveLog() as log:
        for op in (tp.copy_to_tensor_model_parallel_region,
                   tp.reduce_from_tensor_model_parallel_region,
                   tp.scatter_to_tensor_model_parallel_region,
                   tp.gather_from_tensor_model_parallel_region,
                   tp.scatter_to_sequence_parallel_region,
                   tp.gather_from_sequence_parallel_region,
                   tp.reduce_scatter_to_sequence_parallel_region):
            y = op(x)
            assert torch.equal(y, x), op.__name__
            y.sum().backward()
            assert torch.equal(x.grad, torch.ones(4, 6)), op.__name__
            x.grad = None
    assert log.events == []


def test_backward_called_directly_takes_a_context_as_in_megatron_core(world_of_one):
    # Megatron-core's tests/unit_tests/tensor_parallel/test_mappings.py: a stand-in context
    # holding what forward would have stored, and the gradients tuple, None for the group.
    ctx = types.SimpleNamespace(group=ps.get_tensor_model_parallel_group())
    x = torch.ones(1) * 3
    grad, none = mappings._CopyToModelParallelRegion.backward(ctx, x)
    assert torch.equal(grad, x) and none is None
    ctx.tensor_parallel_output_grad = False
    assert mappings._GatherFromSequenceParallelRegion.backward(ctx, x)[1:] == (None, None)


def test_column_parallel_at_tp1_equals_torch_linear(world_of_one):
    torch.manual_seed(3)
    col = tp.ColumnParallelLinear(16, 12, keep_master_weight_for_test=True)
    torch.manual_seed(3)
    dense = torch.empty(12, 16)
    torch.nn.init.xavier_normal_(dense)
    assert torch.equal(col.weight, dense) and torch.equal(col.master_weight, dense)
    assert torch.equal(col.bias, torch.zeros(12))
    assert (col.weight.tensor_model_parallel, col.weight.partition_dim) == (True, 0)
    x = torch.randn(5, 2, 16)
    y, bias = col(x)
    assert bias is None and torch.equal(y, F.linear(x, dense, torch.zeros(12)))
    col.skip_bias_add = True
    y, bias = col(x)
    assert bias is col.bias and torch.equal(y, F.linear(x, dense))


def test_row_parallel_at_tp1_equals_torch_linear(world_of_one):
    torch.manual_seed(4)
    row = tp.RowParallelLinear(16, 12, keep_master_weight_for_test=True)
    assert (row.weight.tensor_model_parallel, row.weight.partition_dim) == (True, 1)
    x = torch.randn(5, 16)
    y, bias = row(x)
    assert bias is None and torch.equal(y, F.linear(x, row.master_weight) + torch.zeros(12))
    no_bias = tp.RowParallelLinear(16, 12, bias=False)
    assert no_bias.bias is None and no_bias(x)[1] is None


def test_layers_without_master_weight_keep_none(world_of_one):
    assert tp.ColumnParallelLinear(8, 8).master_weight is None
    assert tp.RowParallelLinear(8, 8).master_weight is None


def test_vocab_parallel_embedding_at_tp1_equals_f_embedding(world_of_one):
    torch.manual_seed(5)
    emb = tp.VocabParallelEmbedding(20, 6, keep_master_weight_for_test=True)
    ids = torch.randint(0, 20, (3, 7))
    assert (emb.vocab_start_index, emb.vocab_end_index) == (0, 20)
    assert torch.equal(emb(ids), F.embedding(ids, emb.master_weight))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_vocab_parallel_cross_entropy_at_tp1_equals_f_cross_entropy(world_of_one, smoothing):
    torch.manual_seed(6)
    logits = torch.randn(4, 3, 10, requires_grad=True)
    target = torch.randint(0, 10, (4, 3))
    loss = tp.vocab_parallel_cross_entropy(logits, target, label_smoothing=smoothing)
    assert loss.shape == target.shape
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, 10), target.view(-1), reduction="none",
                          label_smoothing=smoothing).view_as(target)
    assert (loss - ref).abs().max() <= 1e-6
    loss.sum().backward()
    ref.sum().backward()
    assert (logits.grad - ref_logits.grad).abs().max() <= 1e-6


def test_vocab_parallel_cross_entropy_rejects_bad_label_smoothing(world_of_one):
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        tp.vocab_parallel_cross_entropy(torch.randn(2, 5), torch.tensor([0, 1]), label_smoothing=1.5)


def test_broadcast_data_on_group_of_one_returns_the_dict(world_of_one):
    data = {"tokens": torch.arange(12).view(3, 4), "mask": torch.arange(5)}
    out = tp.broadcast_data(["tokens", "mask"], data, torch.int64)
    assert torch.equal(out["tokens"], data["tokens"]) and torch.equal(out["mask"], data["mask"])
    with pytest.raises(TypeError, match="'tokens' has dtype torch.int64, expected torch.float32"):
        tp.broadcast_data(["tokens"], data, torch.float32)


def test_1d_split_and_gather_round_trip_on_group_of_one(world_of_one):
    x = torch.arange(8.0).view(2, 4)
    chunk = tp.split_tensor_into_1d_equal_chunks(x)
    assert torch.equal(chunk, x.view(-1)) and chunk.data_ptr() == x.data_ptr()
    assert torch.equal(tp.gather_split_1d_tensor(x), x.view(-1))


def test_rng_fork_uses_seed_plus_2718_and_restores_default_stream(world_of_one):
    tp.model_parallel_manual_seed(42)
    first = torch.rand(4)
    with tp.get_rng_tracker().fork():
        forked = torch.rand(4)
    second = torch.rand(4)
    torch.manual_seed(42)
    assert torch.equal(torch.rand(4), first) and torch.equal(torch.rand(4), second)
    torch.manual_seed(42 + 2718 + 0)                      # tp rank 0
    assert torch.equal(torch.rand(4), forked)
    with tp.get_rng_tracker().fork():                     # the stream goes on where it stopped
        more = torch.rand(4)
    torch.manual_seed(42 + 2718)
    torch.rand(4)
    assert torch.equal(torch.rand(4), more)


def test_rng_tracker_refuses_reused_seed_name_and_unknown_stream():
    tracker = tp.RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="model_parallel_manual_seed"):
        with tracker.fork("missing"):
            pass


def test_checkpoint_recomputes_same_dropout_inside_and_outside_fork(world_of_one):
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    x = torch.randn(4, 8)

    def block(inp):
        h = F.dropout(inp @ w, 0.5)                  # default stream
        with tp.get_rng_tracker().fork():
            h = F.dropout(h, 0.5)                    # tensor-parallel stream
        return torch.tanh(h)

    grads = []
    for use_checkpoint in (False, True):
        tp.model_parallel_manual_seed(7)
        inp = x.clone().requires_grad_()
        out = tp.checkpoint(block, False, inp) if use_checkpoint else block(inp)
        torch.rand(3)                                # draws between forward and backward
        with tp.get_rng_tracker().fork():
            torch.rand(3)
        out.sum().backward()
        grads.append((out.detach(), inp.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[0][1], grads[1][1])
    assert grads[0][1].abs().sum() > 0
