"""Lab 10's lessons (mpu_lab.labkit.context_parallel.lessons) against values worked by hand and independent
references, in one process; the measurements on a live world run in the lab itself (nbval) and
in the grader tests.

* the contiguous and zig-zag layouts, and the causal pairs per rank: s = 16, cp = 2 by hand
  (contiguous 36 / 100, zig-zag 68 / 68);
* the ring's schedule: Megatron's layout at s = 8, cp = 2, block by block, and every causal
  pair of the whole score matrix computed exactly once over the ranks and steps (cp = 2, 3, 4);
* the running log-sum-exp ends at torch.logsumexp of the dense causal scores;
* the contiguous split's block attention equals SDPA of the whole sequence;
* bytes on the wire per message kind, and the cost model's rows at cp = 2 worked by hand;
* the prediction check of section 3: (2cp - 1)/cp^2, and a count of pairs that tends to it;
* on 4 real ranks (tests/mp/cp_lesson_checks.py, slow): the activation bytes, the FLOPs per
  rank of both layouts and the bytes each comm type sends, against values worked by hand.
"""
import pathlib

import pytest
import torch
import torch.nn.functional as F

from mpu_lab import launcher
from mpu_lab.labkit.context_parallel import lessons as cp_lessons
from mpu_lab.labkit.context_parallel.exercises import check_last_rank_share, last_rank_share
from mpu_lab.labkit.context_parallel import viz as cp_viz


def test_layouts_worked_by_hand():
    assert cp_lessons.positions(16, 0, 2, "zig-zag") == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_lessons.positions(16, 1, 2, "zig-zag") == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_lessons.positions(16, 1, 2, "contiguous") == list(range(8, 16))
    with pytest.raises(ValueError, match="layout must be one of"):
        cp_lessons.positions(16, 0, 2, "striped")


def test_causal_pairs_per_rank_worked_by_hand():
    # contiguous: 1 + ... + 8 = 36 and 9 + ... + 16 = 100; zig-zag: (1+2+3+4) + (13+...+16) = 68
    assert cp_lessons.causal_work(16, 2, "contiguous") == [36, 100]
    assert cp_lessons.causal_work(16, 2, "zig-zag") == [68, 68]
    assert sum(cp_lessons.causal_work(32, 4, "zig-zag")) == 32 * 33 // 2


def test_ring_schedule_at_s8_cp2_block_by_block():
    # rank 0 holds 0,1,6,7 and rank 1 holds 2..5
    (r0s0, r0s1), (r1s0, r1s1) = cp_lessons.ring_schedule(2, 8)
    assert (r0s0["kv_rank"], r0s1["kv_rank"], r1s1["kv_rank"]) == (0, 1, 0)
    assert r0s0["kind"] == "own block, causal mask"
    assert (len(r0s0["computed"]), r0s0["masked"]) == (10, 6)      # 4 x 4 pairs, 10 at or below
    assert r0s1["kind"] == "back chunk x all keys"                  # queries 6, 7 see keys 2..5
    assert sorted(r0s1["computed"]) == [(q, k) for q in (6, 7) for k in (2, 3, 4, 5)]
    assert r1s1["kind"] == "all queries x front chunk"              # queries 2..5 see keys 0, 1
    assert sorted(r1s1["computed"]) == [(q, k) for q in (2, 3, 4, 5) for k in (0, 1)]
    assert (r1s0["masked"], r0s1["masked"], r1s1["masked"]) == (6, 0, 0)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_every_causal_pair_is_computed_exactly_once(cp):
    s = 4 * cp
    pairs = [p for steps in cp_lessons.ring_schedule(cp, s) for st in steps for p in st["computed"]]
    assert sorted(pairs) == [(q, k) for q in range(s) for k in range(q + 1)]
    assert cp_lessons.format_ring_schedule(cp_lessons.ring_schedule(cp, s)).count("\n") == cp * cp - 1


@pytest.mark.parametrize("cp, rank", [(2, 0), (2, 1), (4, 2)])
def test_running_lse_ends_at_the_dense_log_sum_exp(cp, rank):
    s, d = 8 * cp, 4
    trace = cp_lessons.running_lse(s, cp, rank, d=d, seed=3)
    q, k, _ = cp_lessons.attention_inputs(s, 1, 1, d, seed=3)
    scores = (q[:, 0, 0] @ k[:, 0, 0].T) * d ** -0.5          # [s, s], independent of the ring
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    dense = torch.logsumexp(scores, dim=-1)[trace["positions"]]
    assert torch.allclose(torch.tensor(trace["steps"][-1]), dense, atol=1e-5)
    assert len(trace["steps"]) == cp
    assert cp_lessons.format_running_lse(trace).splitlines()[0].split() == (
        ["query"] + [w for i in range(cp) for w in ("step", str(i))] + ["dense"])


@pytest.mark.parametrize("cp, rank", [(2, 0), (2, 1), (4, 3)])
def test_the_contiguous_split_equals_sdpa(cp, rank):
    s = 4 * cp
    q, k, v = cp_lessons.attention_inputs(s, 2, 2, 4, seed=1)
    dense = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                           is_causal=True).permute(2, 0, 1, 3)
    got = cp_lessons.contiguous_causal_attention(q, k, v, rank, cp, 4 ** -0.5)
    assert torch.allclose(got, dense[rank * s // cp:(rank + 1) * s // cp], atol=1e-6)


def test_bytes_on_the_wire_per_kind():
    assert cp_lessons.sent_bytes("send", 100, 4) == 100
    assert cp_lessons.sent_bytes("recv", 100, 4) == 0
    assert cp_lessons.sent_bytes("all_gather", 100, 4) == 300
    assert cp_lessons.sent_bytes("reduce_scatter", 400, 4) == 300
    assert cp_lessons.sent_bytes("all_to_all", 400, 4) == 300
    with pytest.raises(ValueError, match="no byte count for 'broadcast'"):
        cp_lessons.sent_bytes("broadcast", 1, 2)


def test_bytes_rows_at_cp2_worked_by_hand():
    # s = 16, b = 2, h = 16, cp = 2, fp32: one K or V block = 8 * 2 * 16 * 4 = 1024 bytes.
    # Events made by hand: a p2p forward of one send of [K; V] = 2048, and a backward of three
    # sends = 6144 where the formula counts 4(cp-1) blocks = 4096: the table shows a mismatch.
    p2p = [dict(kind="send", backward=False, bytes=2048), dict(kind="recv", backward=False, bytes=2048)]
    p2p += [dict(kind="send", backward=True, bytes=2048)] * 3
    allgather = [dict(kind="all_gather", backward=False, bytes=2048),
                 dict(kind="reduce_scatter", backward=True, bytes=4096)]
    rows = cp_lessons.bytes_rows({"p2p": p2p, "allgather": allgather}, 16, 2, 16, 2)
    assert [(r["forward"], r["forward_formula"], r["backward"], r["backward_formula"])
            for r in rows] == [(2048, 2048, 6144, 4096), (2048, 2048, 2048, 2048)]
    text = cp_lessons.format_bytes_rows(rows, 1024)
    assert "2, 2 / 6, 4" in text and "all_gather, reduce_scatter" in text


def test_the_memory_formula_divides_by_cp():
    for s in (512, 1024):
        assert cp_lessons.formula_bytes(s, 1, 64, 8, 2) * 2 == cp_lessons.formula_bytes(s, 1, 64, 8, 1)


def test_last_rank_share_worked_by_hand(capsys):
    assert last_rank_share(4) == 7 / 16          # positions 3s/4..s: (s/4)(7s/8) of s^2/2
    assert last_rank_share(1) == 1
    counted = cp_lessons.causal_work(4096, 4, "contiguous")
    assert abs(counted[-1] / sum(counted) - 7 / 16) < 1e-3
    assert check_last_rank_share(0.44, cp=4)
    assert check_last_rank_share(43.75, cp=4)      # a percentage
    assert capsys.readouterr().out.startswith("Right: (2cp - 1)/cp^2 = 0.4375")
    assert not check_last_rank_share(0.25, cp=4)
    assert "Hint:" in capsys.readouterr().out
    assert not check_last_rank_share(None, cp=4)
    assert capsys.readouterr().out.startswith("No answer yet")
    with pytest.raises(ValueError, match="cp must be a positive integer, got 0"):
        last_rank_share(0)


def test_the_ring_picture_marks_each_cell_by_hand():
    schedule = cp_lessons.ring_schedule(2, 8)
    grid = cp_viz.ring_step_grid(schedule, 8, rank=0, step=1)
    # rank 0 (queries 0, 1, 6, 7) at step 1 holds keys 2..5: queries 6, 7 compute all four,
    # queries 0, 1 hold them but skip them (all in their future); step 0's 10 pairs are done
    assert (grid == 2).sum() == 8 and (grid == 4).sum() == 8 and (grid == 1).sum() == 10
    assert grid[6, 2] == 2 and grid[0, 5] == 4 and grid[7, 7] == 1 and grid[3, 3] == 0
    fig = cp_viz.plot_ring_steps(2, 8)
    assert len(fig.axes) == 4


# --------------------------------------------------------------------------- on 4 real ranks
WORKER = pathlib.Path(__file__).resolve().parents[2] / "mp" / "cp_lesson_checks.py"


@pytest.fixture(scope="module")
def four_rank_reports():
    job = launcher.run(WORKER, [], nproc=4, timeout_s=300, show="none")
    assert [r["rank"] for r in job.results] == [0, 1, 2, 3]
    return job.results


@pytest.mark.slow
def test_measured_on_four_ranks_against_hand_worked_values(four_rank_reports):
    cp, block = 4, 32 // 4 * 2 * 16 * 4          # one K or V block: (s/cp) b h fp32 bytes
    for rank, rep in enumerate(four_rank_reports):
        (mem,) = rep["memory"]
        assert mem["cp1"] == mem["cp1_formula"] and mem["cp"] == mem["cp_formula"]
        assert mem["cp1"] == 4 * mem["cp"]
        # contiguous: rank r computes r + 1 blocks of 4 (s/cp)^2 b n d FLOPs (QK^T and PV);
        # zig-zag: its own [2c, 2c] block, then cp - 1 half blocks (c = s / 2cp = 32)
        assert rep["flops"]["contiguous"] == (rank + 1) * 4 * 64 * 64 * 1 * 2 * 8
        assert rep["flops"]["zig-zag"] == 4 * 64 * 64 * 16 + 3 * 2 * 32 * 64 * 16 * 2
        assert rep["flops"]["equal to dense"]
        sent = {ct: cp_lessons.bytes_rows({ct: ev}, 32, 2, 16, cp)[0]
                for ct, ev in rep["messages"].items()}
        # p2p: [K; V] to the next rank cp - 1 times; backward again, and [dK; dV] cp - 1 times
        # (TransformerEngine's count: each rank keeps its share of its own block's at home)
        assert (sent["p2p"]["forward"], sent["p2p"]["backward"]) == (6 * block, 12 * block)
        # a2a: [q; k; v] and the output, 3/4 of each leaves; allgather: [K; V] to 3 peers
        assert sent["a2a"]["forward"] == sent["a2a"]["backward"] == 3 * block
        assert sent["allgather"]["forward"] == sent["allgather"]["backward"] == 6 * block
        for ct in ("p2p", "a2a", "allgather"):
            assert sent[ct]["forward"] == sent[ct]["forward_formula"]
            assert sent[ct]["backward"] == sent[ct]["backward_formula"]


def test_ranks_that_agree_print_one_table_and_ranks_that_differ_one_each():
    from mpu_lab.labkit.context_parallel.lessons import format_ranks_once
    assert format_ranks_once("bytes", ["a\nb", "a\nb"]) == \
        "bytes;\nthe 2 ranks agree, one table for all:\na\nb"
    assert format_ranks_once("bytes", ["a", "c"]) == "rank 0: bytes\na\nrank 1: bytes\nc"
