"""Single-process tests of mpu_lab.core.transformer, datasets, training helpers (TP=1 in this process)."""
import math

import pytest
import torch

from mpu_lab.training import datasets
from mpu_lab import training
from mpu_lab.training.checkpointing import CheckpointError, find_checkpoint, gather_model_state_dict
from mpu_lab.core.models.gpt import GPTModel, pad_vocab_size
from mpu_lab.core.transformer import SelfAttention, TransformerLayer, TransformerConfig
from mpu_lab.training.plain_gpt import PlainGPT
from mpu_lab.perf.layer_shapes import format_shape_table, shape_table
from mpu_lab.core.transformer.attention import explicit_causal_attention
from mpu_lab.perf.comm_counts import count_collectives, expected_layer_counts


pytestmark = pytest.mark.usefixtures("world")   # a one-rank world (tests/conftest.py)


def small_config(**kw):
    return TransformerConfig(**dict(dict(num_layers=2, hidden_size=64, num_attention_heads=4), **kw))


def test_gpt_at_tp1_equals_the_plain_pytorch_twin_forward_and_backward():
    torch.manual_seed(0)
    cfg = small_config()
    model = GPTModel(cfg, 256, 32)
    twin = PlainGPT.from_config(cfg, 256, 32)
    twin.load_state_dict(gather_model_state_dict(model))
    ids, labels = torch.randint(0, 256, (3, 32)), torch.randint(0, 256, (3, 32))
    a, b = model(ids, labels=labels), twin(ids, labels=labels)
    assert a.shape == (3, 32) and torch.allclose(a, b, atol=1e-6, rtol=0)
    a.mean().backward()
    b.mean().backward()
    grads = dict(model.named_parameters())
    for name, p in twin.named_parameters():
        assert torch.allclose(grads[name].grad, p.grad, atol=5e-6, rtol=0), name
    logits = model(ids)
    assert logits.shape == (3, 32, 256) and torch.allclose(logits, twin(ids), atol=1e-5)


def test_transformer_layer_equals_dense_layer_within_5e_5():
    torch.manual_seed(1)
    cfg = small_config(activation="relu")
    layer = TransformerLayer(cfg)
    dense = PlainGPT(1, 64, 4, vocab_size=256, max_sequence_length=16, ffn_hidden_size=256,
                     activation="relu").decoder.layers[0]        # its one plain layer
    dense.load_state_dict({k: v for k, v in layer.state_dict().items()})
    x = torch.randn(16, 3, 64)                                   # [s, b, h]
    assert (layer(x).transpose(0, 1) - dense(x.transpose(0, 1))).abs().max() <= 5e-5


def test_explicit_attention_equals_sdpa_within_5e_6():
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (explicit_causal_attention(q, k, v) - sdpa).abs().max() <= 5e-6


def test_fused_qkv_rows_are_grouped_by_head():
    # Megatron's layout: rows [3H j, 3H j + H) are W^Q of head j, then W^K, then W^V, so a
    # contiguous block of 3D/t rows holds whole heads. Rebuild attention by hand from it.
    torch.manual_seed(3)
    cfg = small_config()
    attn = SelfAttention(cfg)
    x = torch.randn(8, 2, 64)                                    # [s, b, D]
    W, bias = attn.linear_qkv.weight, attn.linear_qkv.bias
    H, heads = 16, []
    for j in range(4):
        rows = slice(3 * H * j, 3 * H * (j + 1))
        qkv = x @ W[rows].T + bias[rows]                         # [s, b, 3H]
        q, k, v = (t.permute(1, 0, 2) for t in qkv.split(H, dim=-1))  # [b, s, H]
        scores = (q @ k.transpose(1, 2) / math.sqrt(H)).masked_fill(
            torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(torch.softmax(scores, -1) @ v)              # [b, s, H]
    z = torch.cat(heads, dim=-1).transpose(0, 1)                 # [s, b, D]
    out, b_o = attn(x)
    expected = z @ attn.linear_proj.weight.T
    assert torch.allclose(out, expected, atol=1e-5)


def test_shape_table_at_tp1_matches_the_lecture_and_prints():
    rows = shape_table(batch_size=2, seq_length=8, hidden_size=16, num_attention_heads=4,
                       tensor_model_parallel_size=1)
    assert all(tuple(r["shape"]) == tuple(r["expected"]) for r in rows)
    text = format_shape_table(rows)
    assert "Score_i" in text and "2 x 8 x 8" in text
    with pytest.raises(ValueError, match="differs"):
        shape_table(tensor_model_parallel_size=2)


def test_no_collectives_at_tp1():
    torch.manual_seed(0)
    model = GPTModel(small_config(), 256, 32)
    ids = torch.randint(0, 256, (2, 32))
    assert count_collectives(model, ids, ids) == []
    assert expected_layer_counts(False, 1) == {"forward": {}, "backward": {}}


# --------------------------------------------------------------------------- validation
def validate(argv, world_size=1):
    return training.validate_args(training.parse_args(argv), world_size)


@pytest.mark.parametrize("argv,world,message", [
    (["--num-attention-heads", 6, "--hidden-size", 60, "--tensor-model-parallel-size", 4], 4,
     r"--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4.*"
     r"valid with the other flags as given: --tensor-model-parallel-size 1 or 2; "
     r"or --num-attention-heads 4$"),
    (["--hidden-size", 66, "--num-attention-heads", 4], 1, "--hidden-size 66 is not divisible by --num-attention-heads 4"),
    (["--sequence-parallel", "--tensor-model-parallel-size", 4, "--seq-length", 30], 4,
     "--seq-length 30 is not divisible by --tensor-model-parallel-size 4"),
    (["--tensor-model-parallel-size", 3], 4, r"world size 4 is not divisible .*--tensor-model-parallel-size 1, 2 or 4$"),
    (["--micro-batch-size", 4, "--global-batch-size", 12], 2, "--global-batch-size 12 must be a multiple of .* 4 x 2 = 8"),
    (["--fp16", "--bf16"], 1, "exclude each other"),
    # pipeline parallelism
    (["--num-layers", 3, "--pipeline-model-parallel-size", 2], 2,
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (["--num-layers", 4, "--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 3], 2,
     r"--num-layers-per-virtual-pipeline-stage 3 does not divide the 2 layers of each stage.*"
     r"--num-layers-per-virtual-pipeline-stage 2$"),
    (["--num-layers", 4, "--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 1,
      "--micro-batch-size", 2, "--global-batch-size", 2], 2,
     r"--global-batch-size 2 / \(--micro-batch-size 2 x DP 1\) = 1 micro-batches per step, "
     r"not divisible by 2.*--global-batch-size 4, 8 or 16"),
    (["--num-layers", 2, "--pipeline-model-parallel-size", 2, "--micro-batch-size", 4,
      "--global-batch-size", 12], 4, "--global-batch-size 12 must be a multiple of .* 4 x 2 = 8"),
    (["--num-layers", 2, "--pipeline-model-parallel-size", 2, "--pipeline-schedule", "zigzag"], 2,
     r"--pipeline-schedule zigzag is not a pipeline schedule; choose one of GPipe, 1F1B, "
     r"Interleaved1F1B, ZBH1, ZBVZeroBubble, DualPipeV"),
    (["--num-layers", 4, "--pipeline-model-parallel-size", 2, "--pipeline-schedule", "gpipe",
      "--num-layers-per-virtual-pipeline-stage", 1], 2,
     "--pipeline-schedule gpipe runs one model chunk per stage, but "
     "--num-layers-per-virtual-pipeline-stage 1 makes 2 chunks"),
    (["--pipeline-schedule", "1f1b"], 2, r"--pipeline-schedule needs --pipeline-model-parallel-size > 1"),
    (["--pipeline-model-parallel-size", 3, "--num-layers", 3], 4,
     r"world size 4 is not divisible by tensor x pipeline parallel size 1 x 3 = 3"),
    (["--load", "/nonexistent/ckpt"], 1, "does not exist"),
])
def test_bad_configurations_raise_before_any_process_starts(argv, world, message):
    with pytest.raises(ValueError, match=message):
        validate(argv, world)


def test_pipeline_flags_fill_in_schedule_and_virtual_stages():
    args = validate(["--num-layers", 8, "--pipeline-model-parallel-size", 2, "--micro-batch-size", 2,
                     "--global-batch-size", 16, "--num-layers-per-virtual-pipeline-stage", 2], 4)
    assert (args.data_parallel_size, args.num_micro_batches) == (2, 4)
    assert (args.pipeline_schedule, args.virtual_pipeline_model_parallel_size) == ("Interleaved1F1B", 2)
    training.validate_args(args, 4)   # idempotent
    args = validate(["--num-layers", 4, "--pipeline-model-parallel-size", 2], 2)
    assert (args.pipeline_schedule, args.virtual_pipeline_model_parallel_size) == ("1F1B", None)
    args = validate(["--num-layers", 4, "--pipeline-model-parallel-size", 2, "--pipeline-schedule", "AFAB"], 2)
    assert args.pipeline_schedule == "GPipe"
    args = validate([], 1)
    assert (args.pipeline_schedule, args.virtual_pipeline_model_parallel_size) == (None, None)


def test_vocab_is_padded_to_a_multiple_of_128_times_tp():
    assert pad_vocab_size(50257, 128, 1) == 50304
    assert pad_vocab_size(50257, 128, 2) == 50432
    args = validate(["--vocab-size", 500, "--tensor-model-parallel-size", 2], 2)
    assert args.padded_vocab_size == 512
    assert "12 dummy tokens" in training.vocab_padding_message(args)


def test_derived_batch_values_and_validation_is_idempotent():
    args = validate(["--micro-batch-size", 2, "--global-batch-size", 16, "--lr-warmup-fraction", 0.1], 4)
    assert (args.data_parallel_size, args.num_micro_batches, args.lr_warmup_steps) == (4, 2, 30)
    training.validate_args(args, 4)   # a second pass (train_gpt.py, then pretrain) is harmless


def test_learning_rate_schedules():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cos = training.OptimizerParamScheduler(opt, 1.0, 0.1, warmup_steps=10, decay_steps=110, decay_style="cosine")
    assert cos.get_lr(0) == 0.0 and cos.get_lr(5) == 0.5 and cos.get_lr(10) == 1.0
    assert math.isclose(cos.get_lr(60), 0.55) and math.isclose(cos.get_lr(110), 0.1)
    assert cos.get_lr(500) == 0.1
    lin = training.OptimizerParamScheduler(opt, 1.0, 0.0, 0, 100, "linear")
    assert math.isclose(lin.get_lr(25), 0.75)
    const = training.OptimizerParamScheduler(opt, 1.0, 0.0, 0, 100, "constant")
    assert const.get_lr(99) == 1.0


# --------------------------------------------------------------------------- data
def test_mock_dataset_is_deterministic_and_follows_its_graph():
    a, b = datasets.MockGPTDataset(10, 32, 512, seed=7), datasets.MockGPTDataset(10, 32, 512, seed=7)
    assert torch.equal(a[3]["tokens"], b[3]["tokens"])
    assert not torch.equal(a[3]["tokens"], a[4]["tokens"])
    seq = a.sequence(3)
    assert all(seq[t + 1] in a.successors[seq[t]] for t in range(32))
    assert torch.equal(a[3]["labels"][:-1], a[3]["tokens"][1:])


def test_data_parallel_ranks_read_disjoint_slices_of_each_global_batch():
    seen = []
    for r in range(2):
        for m in range(3):
            seen += datasets.batch_indices(5, m, 4, r, 2, 3)
    assert sorted(seen) == list(range(5 * 24, 6 * 24))


def test_byte_text_dataset(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello world, " * 20)
    ds = datasets.ByteTextDataset(str(path), 4, 16)
    assert datasets.decode_bytes(ds[0]["tokens"]).strip(" ,") != ""
    with pytest.raises(ValueError, match="holds 5 bytes"):
        (tmp_path / "s.txt").write_text("short")
        datasets.check_text_file(str(tmp_path / "s.txt"), 16)


def test_missing_checkpoint_paths_raise_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="neither"):
        find_checkpoint(tmp_path)
    (tmp_path / "iter_0000005").mkdir()
    with pytest.raises(CheckpointError, match="partial"):
        find_checkpoint(tmp_path)
