"""Lab 13's lessons (mpu_lab.labkit.mixture_of_experts.lessons) and pictures (mpu_lab.labkit.mixture_of_experts.viz), the
pure parts, against values worked by hand or published: Mixtral 8x7B's 46.7 B / 12.9 B
parameters (Mistral AI's announcement), Switch's capacity ceil(T k / E x factor), the expert
groups of an 8-rank world at t = 2, ep = 2 listed by hand, and the bytes of a dispatch.
(The rank-side lessons run on the grading world:
tests/labkit/mixture_of_experts/test_mixture_of_experts_exercises.py.)
"""
import math

import pytest
import torch

from mpu_lab.labkit.mixture_of_experts import lessons as ml
from mpu_lab.labkit.mixture_of_experts import viz as moe_viz


def test_more_experts_add_parameters_but_not_flops_per_token():
    rows = {r["experts"]: r for r in ml.why_moe_rows(experts=(1, 8, 64))}
    assert rows[8]["total"] == pytest.approx(46.7e9, rel=5e-3)       # Mistral AI, Dec 2023
    assert rows[8]["active"] == pytest.approx(12.9e9, rel=5e-3)
    assert rows[1]["total"] == rows[1]["active"]                      # one expert: dense
    # from 8 to 64 experts at top-2 a token meets only 56 more router columns per layer:
    # 32 layers x 4096 x 56 parameters, 2 FLOPs each
    assert rows[64]["active"] - rows[8]["active"] == 32 * 4096 * 56
    assert rows[64]["flops"] - rows[8]["flops"] == 2 * 32 * 4096 * 56
    # ... and 56 more experts of 3 x 4096 x 14336 in every layer
    assert rows[64]["total"] - rows[8]["total"] == 32 * (56 * 3 * 4096 * 14336 + 4096 * 56)


def test_capacity_keeps_at_most_capacity_tokens_per_expert_and_drops_the_rest():
    d = ml.capacity_demo(num_tokens=32, num_experts=4, topk=1, capacity_factor=1.0)
    assert d["capacity"] == math.ceil(32 * 1 / 4 * 1.0) == 8
    assert sum(d["before"]) == 32
    assert d["kept"] == [min(b, 8) for b in d["before"]]
    assert d["dropped"] == sum(max(b - 8, 0) for b in d["before"]) > 0
    # a kept (token, expert) pair has a probability no lower than any dropped one's
    dropped = d["routing_map"] & ~d["kept_map"]
    for e in range(4):
        if dropped[:, e].any():
            assert d["probs"][d["kept_map"][:, e], e].min() >= d["probs"][dropped[:, e], e].max()
    assert ml.capacity_demo(capacity_factor=4.0)["dropped"] == 0      # capacity 32: none


def test_expert_groups_lie_inside_the_dense_data_parallel_groups():
    # 8 ranks, t = 2: dense dp groups [0 2 4 6], [1 3 5 7]; ep = 2 splits each in two pairs,
    # and the ranks holding the same experts (expert dp) are the pairs' other members.
    got = ml.expert_groups_in_dense(8, tp=2, ep=2)
    assert got == [([0, 2], [0, 2, 4, 6], [[0, 4], [2, 6]]),
                   ([1, 3], [1, 3, 5, 7], [[1, 5], [3, 7]]),
                   ([4, 6], [0, 2, 4, 6], [[0, 4], [2, 6]]),
                   ([5, 7], [1, 3, 5, 7], [[1, 5], [3, 7]])]
    # ep = d: every replica of the dense MLP holds different experts, no expert dp left
    assert all(len(edp) == 4 and all(len(g) == 1 for g in edp)
               for _, _, edp in ml.expert_groups_in_dense(16, tp=2, pp=2, ep=4))
    with pytest.raises(ValueError, match="expert"):
        ml.expert_groups_in_dense(8, tp=2, ep=3)


def test_dispatch_bytes_all_to_all_against_all_gather():
    d = ml.dispatch_bytes(tokens=4096, hidden=4096, topk=2, ep=8, dtype_bytes=2)
    assert d["alltoall"] == 4096 * 2 * 4096 * 2 * 7 / 8
    assert d["allgather"] == 7 * 4096 * 4096 * 2
    assert d["allgather"] / d["alltoall"] == 8 / 2 and d["smaller"] == "alltoall"
    assert ml.dispatch_bytes(10, 10, topk=2, ep=2)["smaller"] == "same"
    assert ml.dispatch_bytes(10, 10, topk=4, ep=2)["smaller"] == "allgather"


def test_names_reads_rows_by_their_name_block_by_block():
    rows = torch.tensor([[0.0, 0.5], [3.0, 3.5], [101.0, 101.5]])
    assert ml.names(rows) == "[0 3 101]"
    assert ml.names(rows, [2, 0, 1]) == "[0 3 | - | 101]"
    assert ml.choices(torch.tensor([[True, False, True], [False, True, False]])) == \
        "t0->e0,e2  t1->e1"
    assert ml.imbalance_summary([4.0, 2.0, 1.24, 1.36], last=2) == 1.3


def test_the_pictures_draw_what_they_are_given():
    d = ml.capacity_demo()
    fig = moe_viz.plot_routing(d["probs"], d["routing_map"])
    assert [p.get_height() for p in fig.axes[1].patches] == d["before"]
    fig = moe_viz.plot_capacity(d["before"], d["kept"], d["capacity"])
    assert len(fig.axes[0].patches) == 2 * len(d["before"])
    fig = moe_viz.plot_loads({"a": [2.0, 1.5], "b": [3.0, 4.0]}, worst=4.0)
    assert [list(line.get_ydata()) for line in fig.axes[0].lines[:2]] == [[2.0, 1.5], [3.0, 4.0]]


def test_lab_checks_right_and_wrong_answers(capsys):
    from mpu_lab.labkit.mixture_of_experts import exercises as ex
    # Mixtral from 8 to 64 experts: 32 x 56 more experts of 3 x 4096 x 14336 (and router
    # columns) on 46.7 B; the FLOPs per token gain only the 56 router columns per layer
    assert ex.check_moe_scaling((7.8, 1.0)) and not ex.check_moe_scaling((8, 8))
    assert not ex.check_moe_scaling(None) and not ex.check_moe_scaling("big")
    assert ex.check_capacity(8, 32, 4, 1, 1.0)                        # ceil(32 / 4 x 1.0)
    assert ex.check_capacity(10, 10, 3, 2, 1.5)                       # ceil(20 / 3 x 1.5)
    assert not ex.check_capacity(9, 32, 4, 1, 1.0)
    assert ex.check_expert_data_parallel_size(2, 16, 2, 2, 2)         # 16 / (2 x 2 x 2)
    assert ex.check_expert_data_parallel_size(1, 8, 1, 1, 8)
    assert not ex.check_expert_data_parallel_size(4, 16, 2, 2, 2)
    out = capsys.readouterr().out
    assert "Right: the parameters grow 7.8x" in out and "No answer yet" in out
    assert "Not yet: 4 is not it. Hint:" in out


def test_expert_ranks_counts_the_expert_tensor_parallel_split_too():
    # 16 ranks, t = p = ep = 2: a stage has 8 ranks; etp = t = 2 split one expert, ep = 2 such
    # pairs split the experts, so each shard has 8 / (2 x 2) = 2 copies: 2 x 2 = 4 ranks hold it.
    from mpu_lab.labkit.mixture_of_experts import exercises as ex
    assert ex.check_expert_ranks(4, 16, 2, 2, 2)
    assert not ex.check_expert_ranks(2, 16, 2, 2, 2)    # the copies alone (edp)
    assert ex.check_expert_ranks(1, 8, 1, 1, 8)          # one expert per rank, no copy, no split
    assert ex.check_expert_ranks(4, 8, 1, 1, 2)          # etp = 1: 4 copies


def test_rank_group_views_show_the_expert_groups(capsys):
    from mpu_lab.labkit.rank_groups import viz
    viz.show_rank_groups(16, tp=2, pp=2, ep=2, draw=False)
    out = capsys.readouterr().out
    assert out.startswith("n = 16 = t*p*c*d = 2*2*1*4, ep = 2, expert dp = 2")
    # 8 ranks per stage at t = 2, ep = 2: the ep groups pair ranks two apart (worked by hand)
    assert " 8 expert model-parallel groups:\n [g0, g2], [g1, g3], [g4, g6], [g5, g7]" in out
    assert " 8 expert data-parallel groups:\n [g0, g4], [g1, g5], [g2, g6], [g3, g7]" in out
    assert "ep groups crossing a node boundary: 0 of 8" in out
    viz.show_rank_groups(16, tp=2, pp=2, draw=False)                  # ep = 1: as before
    assert "expert" not in capsys.readouterr().out
    groups = {"tp": [[r] for r in range(20)]}
    listed = viz.format_groups(groups, ["tp"], limit=8)
    assert listed.endswith("[g6], [g7], ... (12 more)")
    fig = viz.plot_group_families(16, tp=2, pp=2, ep=2, families=("dp", "ep", "expert-dp"))
    assert "ep=2" in fig._suptitle.get_text() and len(fig.axes) == 3


def test_byte_counts_read_as_a_sentence_not_a_dict():
    from mpu_lab.labkit.mixture_of_experts.lessons import format_byte_counts
    counts = {"all_gather forward": 1536, "reduce_scatter forward": 2048, "all_gather backward": 8}
    assert format_byte_counts(counts) == \
        "all_gather forward 1,536 B, reduce_scatter forward 2,048 B, all_gather backward 8 B"
    assert format_byte_counts(counts, "forward") == \
        "all_gather forward 1,536 B, reduce_scatter forward 2,048 B"


def test_the_course_answer_to_the_ep_mesh_question_waits_for_the_learners(capsys):
    from mpu_lab.labkit.mixture_of_experts import lessons
    for empty in ("", "   ", None):
        lessons.answer_why_ep_divides_dp(empty, 16, tp=2, pp=2, ep=2)
        assert capsys.readouterr().out.startswith("No answer yet:")
    lessons.answer_why_ep_divides_dp("it divides the replicas", 16, tp=2, pp=2, ep=2)
    out = capsys.readouterr().out
    # 16 ranks, t = p = 2: d = 4; ep = 2 leaves edp = 2 copies; an expert on t * edp = 4 ranks
    assert out.startswith("Our answer:") and "d = 4, ep = 2" in out.replace("\n", " ")
    assert "2 x 2 = d*c" in out.replace("\n", " ") and "etp x edp = 4" in out.replace("\n", " ")
    assert max(len(line) for line in out.splitlines()) <= 100


def test_the_load_reading_is_said_from_the_printed_means():
    grows, even = [2.0] * 10 + [2.5] * 10, [2.0] * 10 + [1.2] * 10
    text = ml.load_reading({"aux loss 0.0": grows, "aux loss 0.1": even})
    assert "aux loss 0.0: busiest expert / mean, first 10 steps 2.0, last 10 2.5: it grew" in text
    assert "aux loss 0.1: busiest expert / mean, first 10 steps 2.0, last 10 1.2: it shrank" in text
    assert "the rich get richer" in text and "pushed towards an even load" in text
    flat = [2.0] * 10 + [2.05] * 10          # within 5 %: it stayed, and no rich-get-richer claim
    text = ml.load_reading({"aux loss 0.0": flat, "aux loss 0.1": flat})
    assert "it stayed about the same" in text and "rich get richer" not in text
    assert "no more even than without it" in text
