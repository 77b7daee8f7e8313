"""Lab 16's checks (mpu_lab.labkit.scaling.exercises): right answers worked by hand pass, wrong
ones fail with a hint that does not give the value away, no answer is no verdict, and reveal()
prints the answer."""
import dataclasses

import pytest

from mpu_lab.labkit.scaling import exercises as scaling
from mpu_lab.perf import back_of_envelope as be
from mpu_lab.perf import explore, explorer
from mpu_lab.perf.cost_model import DGX_A100_80GB, DGX_H100, GPT3_175B


@pytest.fixture(scope="module")
def gpt3_on_a100():
    gpt3 = dataclasses.replace(GPT3_175B, vocab_size=51200)
    return explore(gpt3, DGX_A100_80GB.replace(num_nodes=16), num_gpus=128,
                   global_batch_size=1536)


def test_bounds_by_hand(capsys):
    # h = 8192, t = 8: 9·8192/(7·2) = 5,266 FLOPs per byte; ridges 2,198 (NVLink), 19,780 (IB)
    tp = be.tensor_parallel(8192, 4096, 8)
    assert scaling.check_bounds(("compute", "communication"), tp, DGX_H100)
    assert "Right:" in capsys.readouterr().out
    assert not scaling.check_bounds(("compute", "compute"), tp, DGX_H100)
    out = capsys.readouterr().out
    assert "Hint:" in out and "5,266" not in out            # the hint does not give it away
    assert not scaling.check_bounds("compute", tp, DGX_H100)
    assert "not a pair" in capsys.readouterr().out
    assert not scaling.check_bounds(None, tp, DGX_H100)
    assert "No answer yet" in capsys.readouterr().out
    # lab 16's question, h = 2048, t = 8: 9·2048/(7·2) = 1,317 FLOPs per byte, below both ridges
    small = be.tensor_parallel(2048, 4096, 8)
    assert scaling.check_bounds(("communication", "communication"), small, DGX_H100)
    assert not scaling.check_bounds(("compute", "communication"), small, DGX_H100)  # GPT-3's row


def test_critical_hidden_size_by_hand(capsys):
    tp = be.tensor_parallel(4096, 4096, 8)
    # 9h/(7·2) = 989e12/450e9 -> h = 3,418.8
    assert scaling.check_critical(3419, tp, 989e12, 450e9)
    assert scaling.check_critical(3300, tp, 989e12, 450e9)          # within 5 %
    assert not scaling.check_critical(2198, tp, 989e12, 450e9)      # the ridge, not the h
    assert "3,419" not in capsys.readouterr().out.split("Not yet:")[-1]
    assert not scaling.check_critical("a lot", tp, 989e12, 450e9)


def test_tp_share_of_t32_against_the_explorer(gpt3_on_a100, capsys):
    share = gpt3_on_a100.find(32, 4, b=8).prediction.shares()["tp_comm"]
    assert share > 0.5
    assert scaling.check_tp_share(round(share, 2), gpt3_on_a100, 32, 4, 8)
    # the envelope's own estimate: r = ridge/intensity at datasheet rates, share r/(1+r)
    tp = be.tensor_parallel(12288, 8 * 2048, 32)
    r = be.ridge(312e12, 25e9) / tp.intensity
    assert scaling.check_tp_share(r / (1 + r), gpt3_on_a100, 32, 4, 8)
    assert not scaling.check_tp_share(0.2, gpt3_on_a100, 32, 4, 8)
    assert "Hint:" in capsys.readouterr().out


def test_smallest_cp_and_best_ep_of_the_worked_examples(capsys):
    long = explorer.long_sequence_example()
    # 164 GB of activations per stage at t = 8 (the example's docstring): cp = 2 halves them,
    # still too much beside the weights; cp = 4 is the first that fits
    assert scaling.check_smallest_cp(4, long)
    assert not scaling.check_smallest_cp(2, long)
    moe = explorer.moe_example()
    assert scaling.check_best_ep(moe["ranking"][0].ep, moe)
    assert scaling.check_best_ep(8, moe)                     # all 8 experts split, one each
    assert not scaling.check_best_ep(1, moe)
    assert "Hint:" in capsys.readouterr().out


def test_reveal_prints_the_answer_and_refuses_other_functions(gpt3_on_a100, capsys):
    tp = be.tensor_parallel(4096, 4096, 8)
    scaling.reveal(scaling.check_critical, tp, 989e12, 450e9, rel_tol=0.05)
    assert "Answer: h = 3,419" in capsys.readouterr().out
    scaling.reveal(scaling.check_smallest_cp, explorer.long_sequence_example())
    assert "Answer: cp = 4" in capsys.readouterr().out
    scaling.reveal(scaling.check_tp_share, gpt3_on_a100, 32, 4, 8)
    assert "t=32 p=4 b=8" in capsys.readouterr().out
    with pytest.raises(ValueError, match="reveal knows"):
        scaling.reveal(print, 1)
