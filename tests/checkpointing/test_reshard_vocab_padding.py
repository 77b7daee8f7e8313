"""A checkpoint loaded with another vocabulary padding: Megatron pads the vocabulary
to a multiple of make_vocab_size_divisible_by x TP, so the same 130 real ids are 192 rows with
divisor 64, 256 with 128 (as TP = 2 vs TP = 4 would give) and 160 with 32. The loader keeps
every real row, trims or zero-fills the dummy rows (Adam moments alike) and still refuses a
change of the real vocabulary or of the architecture.

One process (the module's one-rank gloo world, TP = 1): the loader's re-padding is the same
code at every TP size, and which rows a TP rank takes is the pure function tested at the end
against a table cut by hand. References: the weights and logits of the saved model itself,
and the cross entropy worked from those logits with the dummy columns added or removed.
"""
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from mpu_lab.training import checkpointing
from mpu_lab import training
from mpu_lab.training.checkpointing import vocab_padding
from mpu_lab.core.models.gpt import pad_vocab_size

VOCAB = 130
BASE = ["--num-layers", 1, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 16,
        "--micro-batch-size", 2, "--vocab-size", VOCAB, "--lr", 3e-3, "--lr-warmup-iters", 1,
        "--train-iters", 3, "--quiet"]
EMBEDDING = checkpointing.TIED_EMBEDDING


def args_for(divisor, *extra):
    argv = BASE + ["--make-vocab-size-divisible-by", divisor] + list(extra)
    return training.validate_args(training.parse_args([str(a) for a in argv]), 1)


def embedding_and_moments(state):
    weight = state.model.embedding.word_embeddings.weight
    st = state.optimizer.state[weight]
    return weight.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()


@pytest.fixture(scope="module")
def saved(world, tmp_path_factory):
    """A model padded to 192 rows (130 real + 62 dummy), trained 2 iterations (so the dummy
    rows and the Adam moments are not zero), saved; its table, moments and logits."""
    root = tmp_path_factory.mktemp("vocab_padding")
    args = args_for(64)
    assert args.padded_vocab_size == 192
    state = training.setup(args, log=lambda s: None)
    training.train(state, train_iters=2, log=lambda s: None)
    batch = training.get_batch(state, 2, 0)
    with torch.no_grad():
        logits = state.model(batch["tokens"])                       # [b, s, 192]
    path = checkpointing.save_checkpoint(root / "ckpt", state)
    return dict(path=path, root=root, table=embedding_and_moments(state), logits=logits,
                batch=batch, iteration=state.iteration)


def resume(saved, divisor):
    args = args_for(divisor, "--load", saved["path"])
    state = training.setup(args, log=lambda s: None)
    with torch.no_grad():
        logits = state.model(saved["batch"]["tokens"])
        loss = state.model(saved["batch"]["tokens"], labels=saved["batch"]["labels"])
    return args, state, logits, loss


def padded_loss(logits, labels, rows):
    """Cross entropy over ``rows`` columns: the saved logits cut, or extended with the
    logit 0 that a zero row gives."""
    if rows > logits.size(-1):
        logits = torch.cat([logits, logits.new_zeros(logits.shape[:-1] + (rows - logits.size(-1),))], -1)
    return F.cross_entropy(logits[..., :rows].reshape(-1, rows), labels.reshape(-1),
                           reduction="none").view_as(labels)


def real_vocab_loss(logits, labels):
    return padded_loss(logits, labels, VOCAB)


def test_more_padding_keeps_every_saved_row_and_adds_zero_rows(saved, capsys):
    args, state, logits, loss = resume(saved, 128)
    assert args.padded_vocab_size == 256
    assert "vocabulary padding 192 -> 256 rows (130 real ids kept, 62 saved dummy rows kept, " \
           "64 zero rows added" in capsys.readouterr().out
    assert state.iteration == saved["iteration"]
    for now, before in zip(embedding_and_moments(state), saved["table"]):   # weight, moments
        assert now.shape == (256, 32)
        assert torch.equal(now[:192], before)
        assert torch.equal(now[192:], torch.zeros(64, 32))
    before = saved["logits"]
    torch.testing.assert_close(logits[..., :192], before, rtol=1e-6, atol=1e-6)
    assert torch.equal(logits[..., 192:], torch.zeros_like(logits[..., 192:]))   # logit 0
    labels = saved["batch"]["labels"]
    torch.testing.assert_close(real_vocab_loss(logits, labels), real_vocab_loss(before, labels))
    # Over the padded vocabulary the 64 new dummy ids (logit 0) take a share: the loss rises.
    torch.testing.assert_close(loss, padded_loss(before, labels, 256), rtol=1e-6, atol=1e-6)
    assert (loss > padded_loss(before, labels, 192)).all()


def test_less_padding_trims_dummy_rows_only(saved, capsys):
    args, state, logits, loss = resume(saved, 32)
    assert args.padded_vocab_size == 160
    assert "192 -> 160 rows (130 real ids kept, 30 saved dummy rows kept, 32 dummy rows " \
           "trimmed" in capsys.readouterr().out
    for now, before in zip(embedding_and_moments(state), saved["table"]):
        assert torch.equal(now, before[:160])
    torch.testing.assert_close(logits, saved["logits"][..., :160], rtol=1e-6, atol=1e-6)
    labels = saved["batch"]["labels"]
    torch.testing.assert_close(loss, padded_loss(saved["logits"], labels, 160), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(real_vocab_loss(logits, labels),
                               real_vocab_loss(saved["logits"], labels))


def test_a_change_of_the_real_vocabulary_or_the_shape_is_refused_before_loading(saved):
    argv = BASE + ["--make-vocab-size-divisible-by", 64, "--load", saved["path"]]
    other = [str(a) for a in argv]
    other[other.index("--vocab-size") + 1] = "140"             # still 192 rows when padded
    with pytest.raises(checkpointing.CheckpointError,
                       match=r"vocab_size: checkpoint 130, this run 140 .*use --vocab-size 130"):
        training.validate_args(training.parse_args(other), 1)
    other = [str(a) for a in argv]
    other[other.index("--hidden-size") + 1] = "64"
    with pytest.raises(checkpointing.CheckpointError, match="hidden_size: checkpoint 32, this run 64"):
        training.validate_args(training.parse_args(other), 1)


def test_a_checkpoint_without_its_real_vocabulary_size_keeps_the_old_rule(saved):
    old = saved["root"] / "old" / saved["path"].name
    shutil.copytree(saved["path"], old)
    marker = old / checkpointing.MARKER
    info = json.loads(marker.read_text())
    del info["vocab_size"]
    marker.write_text(json.dumps(info))
    with pytest.raises(checkpointing.CheckpointError,
                       match=r"padded_vocab_size: checkpoint 192, this run 256 .*does not record"):
        args_for(128, "--load", old)
    args = args_for(128)
    state = training.setup(args, log=lambda s: None)
    with pytest.raises(checkpointing.CheckpointError,
                       match=r"model\.embedding\.word_embeddings\.weight: checkpoint shape "
                             r"\(192, 32\), model shape \(256, 32\)"):
        checkpointing.load_checkpoint(old, state.model)


def test_each_tensor_parallel_rank_takes_its_rows_of_the_repadded_table():
    # 512 ids: Megatron pads to 512 at TP = 2 and to 1024 at TP = 8 (a multiple of 128 x TP).
    assert (pad_vocab_size(512, 128, 2), pad_vocab_size(512, 128, 8)) == (512, 1024)
    table = torch.randn(512, 4)
    ranks = [vocab_padding.repadded_rows(table, *vocab_padding.rows_of(None, 128, r, True))
             for r in range(8)]
    assert torch.equal(torch.cat(ranks), torch.cat([table, torch.zeros(512, 4)]))
    assert torch.equal(ranks[3], table[384:]) and not ranks[4].any()
    # The reverse: saved at TP = 8 (1024 rows), loaded at TP = 2: rank 1 gets rows 256..511.
    big = torch.randn(1024, 4)
    assert torch.equal(vocab_padding.repadded_rows(big, *vocab_padding.rows_of(None, 256, 1, True)),
                       big[256:512])
    assert vocab_padding.row_counts(512, 512, 1024) == dict(real=512, dummy_kept=0, trimmed=0,
                                                           zero_filled=512)
    assert vocab_padding.row_counts(50257, 50688, 50304) == dict(real=50257, dummy_kept=47,
                                                                 trimmed=384, zero_filled=0)
    assert not vocab_padding.can_repad("model.embedding.word_embeddings.weight", (1024, 4),
                                       (512, 4), 600)          # would cut real rows
    assert not vocab_padding.can_repad("model.decoder.final_layernorm.weight", (1024,), (512,), 8)
    assert vocab_padding.can_repad("optimizer.output_layer_weight.exp_avg", (1024, 4), (512, 4), 500)
